"""Fine-tuning harness: does the badly trained last block cost downstream accuracy?

Token classification (first sub-word labelled; entity F1 with seqeval for BIO tasks, accuracy for
tagging) and sequence classification, with optional class weights, block surgery (drop or
re-initialise the last k blocks) and head-only training. See :mod:`gradflow.interventions.finetune.train`.
"""

from gradflow.inputs.tasks import BUILTIN_TASKS, Task, TaskError, accuracy, entity_scores, load_split, load_task, score
from gradflow.interventions.finetune.continued import continue_mlm
from gradflow.interventions.finetune.data import (
                    Encoded,
                    class_weights,
                    collate,
                    encode,
                    encode_texts,
                    encode_tokens,
                    label_counts,
)
from gradflow.interventions.finetune.train import (
                    EvalRecord,
                    FinetuneConfig,
                    FinetuneResult,
                    evaluate,
                    finetune,
                    load_task_model,
                    task_loss,
)

__all__ = [
    "BUILTIN_TASKS", "Encoded", "EvalRecord", "FinetuneConfig", "FinetuneResult", "Task", "TaskError", "accuracy",
    "class_weights", "collate", "continue_mlm", "encode", "encode_texts", "encode_tokens", "entity_scores", "evaluate",
    "finetune", "label_counts", "load_split", "load_task", "load_task_model", "score", "task_loss",
]
