"""One optimizer step of a Hugging Face Trainer with GradAccountingCallback as one of torchrun's 2 CPU ranks (gloo,
DDP as the Trainer sets it up with ``use_cpu=True``): ``python -m torch.distributed.run --nproc-per-node 2
accounting_trainer_worker.py OUT``. The Trainer is test_accounting.py's ``trainer_rows`` one with the 8-row global
batch split between the ranks, for each case of :data:`CASES` in ``OUT/<case>`` (the callback's csv, rank 0's), and
``OUT/<case>/rank<r>.json``: the global-batch rows each of rank r's forwards saw, the callback's rows, the logged
gradient scales and the Trainer's own logged gradient norms on rank r."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import accounting_worker as worker  # noqa: E402

CASES = {"ga1": (1, False), "ga2": (2, False), "ga1_mean": (1, True), "ga2_mean": (2, True)}
"""name: (accumulation steps, ``model_accepts_loss_kwargs`` left on). Off, the Trainer divides each micro-batch's
mean loss by the accumulation and DDP averages the ranks: the global-token normaliser (3 loss tokens a row). On, the
Trainer leaves BertForMaskedLM's micro-batch mean undivided and multiplies it by the world size."""


def rows_of(input_ids: torch.Tensor) -> list[int]:
    """The global batch's row of each of ``input_ids``'s rows (each matches exactly one)."""
    ids = worker.global_batch()["input_ids"]
    found = []
    for row in input_ids.cpu():
        match = [i for i in range(len(ids)) if torch.equal(ids[i], row)]
        assert len(match) == 1, match
        found += match
    return found


def run(out: Path, accumulation: int, loss_kwargs: bool) -> dict:
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments

    from gradflow.interventions.accounting_callback import GradAccountingCallback

    class InOrder(Trainer):
        """The global batch in its order: accelerate then deals the per-device batches to the ranks in turn."""

        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    batch = worker.global_batch()
    data = [{k: batch[k][i] for k in ("input_ids", "attention_mask", "labels")} for i in range(worker.ROWS)]
    world = int(os.environ["WORLD_SIZE"])  # the Trainer's arguments start the process group
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=worker.ROWS // world // accumulation,
                             gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, max_grad_norm=0.0,
                             disable_tqdm=True)
    assert args.world_size == world == torch.distributed.get_world_size() and args.parallel_mode.value == "distributed"
    trainer = InOrder(model=worker.tiny_model(), args=args, train_dataset=data)
    trainer.model_accepts_loss_kwargs = trainer.model_accepts_loss_kwargs and loss_kwargs
    callback = GradAccountingCallback.attach(trainer, every=50)
    seen: list[list[int]] = []
    hook = trainer.model.register_forward_pre_hook(lambda m, a, kw: seen.append(rows_of(kw["input_ids"])),
                                                   with_kwargs=True)
    trainer.train()
    hook.remove()
    assert callback._hook is None and callback._step is None
    return {"rank": torch.distributed.get_rank(), "world": world, "ddp": type(trainer.model_wrapped).__name__,
            "micro_batches": seen, "rows": callback.accounting.rows, "warned": callback.accounting.warned,
            "scales": [h["gradflow/gradient_scale"] for h in trainer.state.log_history
                       if "gradflow/gradient_scale" in h],
            "trainer_grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}


def main(out: str) -> None:
    for name, (accumulation, loss_kwargs) in CASES.items():
        result = run(Path(out) / name, accumulation, loss_kwargs)
        with open(Path(out) / name / f"rank{result['rank']}.json", "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
