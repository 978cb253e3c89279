"""The report figures under ``figures/``: recorded runs and reports (``make_figures``), the channel
view and diagnostics (``make_channel_figures``)."""
