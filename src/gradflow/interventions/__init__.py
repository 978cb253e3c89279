"""Interventions: changing models and watching training.

What it offers (import from the modules):

- :mod:`.callback`: :class:`~gradflow.interventions.callback.GradFlowCallback`, a transformers ``TrainerCallback``;
- :mod:`.surgery`: drop or re-initialise the last k blocks; :mod:`.repair`: train only the last block
  under the all-positions loss (``gradflow repair``);
- :mod:`.finetune`: the fine-tuning harness and continued MLM; :mod:`.vocabulary` and :mod:`.new_rows`:
  new vocabulary rows and where their gradient comes from;
- :mod:`.snapshot`: :func:`~gradflow.interventions.snapshot.training_snapshot`, a plain training loop's probe: one
  batch's training state (hidden-state gradients per role, collapse, attention entropy, embedding gradient by role),
  leaving no trace.
"""
