"""What the recorder records: its options and the per-batch records (CPU tensors) with tidy frames."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gradflow.roles import ROLE_ORDER, TOKEN_ROLES, role_code

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class RecorderConfig:
    """What to record.

    ``sublayers``: the per-role split of every sublayer's weight gradient (else site norms only).
    ``materialize``: also keep every role's summed gradient matrix ``G_r`` (CPU, float32): for
    checks and small models only. ``position_magnitudes``: also keep the (B, T) per-position
    magnitudes of every sublayer parameter. ``adapter``: ``"registered"`` (the adapter registered for
    the model type) or ``"auto"`` (the generic adapter, discovered; see :mod:`gradflow.adapters.generic`);
    an adapter passed to the recorder takes precedence. ``router_aux_loss``: ``rec.record()`` adds the model's
    auxiliary router loss to the loss, times the model's own coefficient (``"model"``) or this float, and measures
    its share (:mod:`gradflow.hooks.router_aux`); None: the loss alone.
    """

    sublayers: bool = True
    materialize: bool = False
    position_magnitudes: bool = False
    adapter: str = "registered"
    router_aux_loss: float | str | None = None


@dataclass
class SublayerRecord:
    """Per-role statistics of one sublayer parameter at one depth. Arrays are (NUM_ROLES,), indexed by role code."""

    depth: int
    sublayer: str
    param: str
    n_positions: torch.Tensor
    n_nonzero: torch.Tensor
    magnitude_sum: torch.Tensor
    contribution_norm: torch.Tensor
    position_magnitude: torch.Tensor | None = None


@dataclass
class BatchRecord:
    """Everything recorded for one batch (all tensors on CPU, float32 unless noted).

    ``grad_norm`` and ``act_norm``: (S, B, T) over ``site_names``; ``roles``: (B, T) int8;
    ``sublayers``: one :class:`SublayerRecord` per (depth, sublayer, parameter);
    ``matrices``: (depth, sublayer, param, role) -> summed gradient of that role, when materialised;
    ``expert_counts``: (depth, experts name) -> (E, NUM_ROLES) long, the rows of each role routed to each expert
    (mixture-of-experts blocks; :mod:`gradflow.hooks.experts`); ``aux_loss``: the auxiliary router loss term added to
    ``loss`` (its coefficient included; None: none added) and ``router_aux``: (depth, sublayer, param) -> the norms of
    that router's or experts weight's gradient from ``loss`` alone and from the term alone
    (:mod:`gradflow.hooks.router_aux`).
    """

    site_names: tuple[str, ...]
    site_layers: tuple[int, ...]
    site_points: tuple[str, ...]
    grad_norm: torch.Tensor
    act_norm: torch.Tensor
    roles: torch.Tensor
    sequence_index: torch.Tensor
    loss: float
    num_blocks: int
    sublayers: list[SublayerRecord] = field(default_factory=list)
    matrices: dict[tuple[int, str, str, str], torch.Tensor] = field(default_factory=dict)
    expert_counts: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    aux_loss: float | None = None
    router_aux: dict[tuple[int, str, str], tuple[float, float]] = field(default_factory=dict)

    def site(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad_norm, act_norm) of one site, each (B, T)."""
        i = self.site_names.index(name)
        return self.grad_norm[i], self.act_norm[i]

    def site_frame(self) -> pd.DataFrame:
        """Tidy per (site, role), roles in display order: n_positions, grad_norm_mean, grad_norm_max, act_norm_mean."""
        rows = []
        roles = self.roles.reshape(-1).long()
        for s, name in enumerate(self.site_names):
            g = self.grad_norm[s].reshape(-1)
            a = self.act_norm[s].reshape(-1)
            for role in TOKEN_ROLES:
                sel = roles == role_code(role)
                n = int(sel.sum())
                if n == 0:
                    continue
                rows.append({"site": name, "layer": self.site_layers[s], "point": self.site_points[s],
                             "role": role, "n_positions": n, "grad_norm_mean": float(g[sel].mean()),
                             "grad_norm_max": float(g[sel].max()), "act_norm_mean": float(a[sel].mean())})
        import pandas as pd  # on use: `import gradflow` stays free of pandas (and pyarrow)

        return pd.DataFrame(rows)

    def sublayer_frame(self) -> pd.DataFrame:
        """Tidy per (layer, sublayer, param, role); ``layer`` = depth + 1; ``share`` sums to 1."""
        rows = []
        for rec in self.sublayers:
            total = float(rec.magnitude_sum.sum())
            for role in ROLE_ORDER:
                code = role_code(role)
                n = int(rec.n_positions[code])
                if n == 0:
                    continue
                mag = float(rec.magnitude_sum[code])
                rows.append({"layer": rec.depth + 1, "sublayer": rec.sublayer, "param": rec.param,
                             "role": role, "n_positions": n, "n_nonzero": int(rec.n_nonzero[code]),
                             "magnitude_sum": mag, "share": mag / total if total > 0 else 0.0,
                             "contribution_norm": float(rec.contribution_norm[code])})
        import pandas as pd  # on use: `import gradflow` stays free of pandas (and pyarrow)

        return pd.DataFrame(rows)


__all__ = ["BatchRecord", "RecorderConfig", "SublayerRecord"]
