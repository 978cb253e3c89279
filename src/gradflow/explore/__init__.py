"""The channel view, live and shareable: one sentence's view as an object, a page and a local server.

- :mod:`gradflow.explore.view`: :func:`channel_view` -> :class:`ChannelView` (table, figure, CSV,
  HTML, Jupyter display);
- :mod:`gradflow.explore.page`: the HTML page, served or self-contained;
- :mod:`gradflow.explore.service`: request checks, model registry and the one-at-a-time queue;
- :mod:`gradflow.explore.server`: the Starlette app behind ``gradflow explore``.
"""

from gradflow.explore.view import LOSSES, ChannelView, channel_view

__all__ = ["LOSSES", "ChannelView", "channel_view"]
