"""Interventions: changing models and watching training.

What it offers (import from the modules):

- :mod:`.callback`: :class:`~gradflow.interventions.callback.GradFlowCallback`, a transformers ``TrainerCallback``;
- :mod:`.surgery`: drop or re-initialise the last k blocks; :mod:`.repair`: train only the last block
  under the all-positions loss (``gradflow repair``);
- :mod:`.finetune`: the fine-tuning harness and continued MLM; :mod:`.vocabulary` and :mod:`.new_rows`:
  new vocabulary rows and where their gradient comes from.
"""
