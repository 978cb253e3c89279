"""Inputs: text to masked batches.

What it offers (import from the modules):

- :mod:`.masking`: :class:`~gradflow.inputs.masking.BertMasking`, :class:`ExplicitMasking`, :func:`mask_batch`,
  :class:`MaskedBatch` (ids, labels and the position roles), :func:`mlm_roles` (roles from a batch's labels);
- :mod:`.corpus`: corpus readers, windows, shards, the default corpus; :mod:`.pipeline`: :func:`masked_batches`;
- :mod:`.labelled`: word-labelled sentences for probes; :mod:`.tasks`: the built-in labelled tasks.
"""
