"""Hooks: one batch, in memory (no files, no CLI).

What it offers (import from the modules; nothing is re-exported here, so importing one module stays light):

- :mod:`.recorder`: :class:`~gradflow.hooks.recorder.GradFlowRecorder` (context manager; ``record(batch)``, or
  ``capture()``/``result()`` around a backward pass you drive) and its :class:`RecorderConfig`;
- :mod:`.records`: :class:`~gradflow.hooks.records.BatchRecord` (per-site, per-role norms; sublayer split; frames);
- :mod:`.sites`: the site layer (:class:`SiteLayer`: forward hooks at ``embeddings.out``, ``blocks.{i}.mid/out``);
- :mod:`.sublayer_stats`, :mod:`.safe_norms`, :mod:`.batch_state`: the per-role weight-gradient split, exact norms;
- :mod:`.attribution`: Captum attributions per site and role; :mod:`.states`: hidden states at every site.
"""
