"""Publication figures for gradflow runs: a shipped style, one colour per role, plot functions.

Plot functions draw inside :func:`gradflow_style` (rcParams are restored afterwards), take
``ax=None`` (a new figure of the ``"single"`` 3.5 in or ``"double"`` 7 in preset is created), and
return the artists they drew. :func:`save_figure` writes a vector PDF and a 300-dpi PNG, byte for
byte the same each time the same figure is saved.

- :mod:`.profiles`: one run's channels (depth profile, ratio heat map, distributions);
- :mod:`.sublayers`: one run's sublayers (coverage/share heat map, last-block bars);
- :mod:`.comparison`: several runs side by side;
- :mod:`.canvas`: the shared axis, heat-map and saving helpers; :mod:`.fitting`: titles, labels
  and legends wrapped and arranged to fit the column width; :mod:`.style`: the style.
"""

from gradflow.figures.canvas import INCOMPLETE_BANNER, add_banner, save_figure
from gradflow.figures.comparison import comparison_last_block, comparison_profiles, comparison_ratios
from gradflow.figures.profiles import depth_profile, distribution_ranges, ratio_heatmap
from gradflow.figures.style import (
    ROLE_COLORS,
    STYLE_PATH,
    WIDTHS,
    figure_size,
    gradflow_style,
    role_color,
    role_label,
    run_style,
)
from gradflow.figures.sublayers import last_block_bars, sublayer_heatmap
from gradflow.schema import REPORTED_ROLES as PLOT_ROLES

__all__ = [
    "INCOMPLETE_BANNER", "PLOT_ROLES", "ROLE_COLORS", "STYLE_PATH", "WIDTHS", "add_banner", "comparison_last_block",
    "comparison_profiles", "comparison_ratios", "depth_profile", "distribution_ranges", "figure_size",
    "gradflow_style", "last_block_bars", "ratio_heatmap", "role_color", "role_label", "run_style", "save_figure",
    "sublayer_heatmap",
]
