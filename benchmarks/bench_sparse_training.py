"""Sparse MLM training speed: tokens/s of a training step, dense vs sparse head vs sparse head + last block.

A training step is forward + MLM loss + backward + AdamW step + zero_grad. Modes:

- dense:  ``model(input_ids, attention_mask, labels=labels).loss``
- head:   ``sparse_mlm(model, block=False)``: the MLM head at the loss positions only
- block:  ``sparse_mlm(model)``: the head and the last block's query side at the loss positions only

on the gradflow-mini-en shape (the embedded model, B=16, T=128, as its recipe trains) and the
bert-base shape (random BertForMaskedLM, B=8, T=128), BERT 15% / 80-10-10 masking, CPU, 2 threads
by default, modes interleaved within each round (median per mode). Beside the measured speed-ups,
the FLOP shares ``gradflow check`` computes for the same model and batch
(:func:`gradflow.runs.check.check_batch`): ``share`` (the last block's zero-context Linear sublayers at
the unselected positions, of the sparse-head total), ``share_with_attention`` (also their attention
rows), and the predicted step-FLOP saving of each mode against the dense step (whose head runs at
every position: ``head_unselected``). Each mode's wall time and process CPU time (all threads; less
sensitive to other processes on a loaded machine: run with ``OMP_WAIT_POLICY=passive`` so that idle
OpenMP threads do not spin) are printed with the load average. Not a test: numbers are printed, never
asserted.

    python benchmarks/bench_sparse_training.py [--rounds 3] [--steps 2] [--threads 2] [--shapes mini,base] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import BertConfig, BertForMaskedLM

from gradflow import BertMasking
from gradflow.inputs.masking import MaskedBatch, TokenizerInfo, mask_sequence
from gradflow.models.loading import load_model
from gradflow.runs.check import check_batch
from gradflow.training import sparse_mlm

MODES = ("dense", "head", "block")


def make_batch(b: int, t: int, vocab: int, mask_id: int, specials: tuple[int, int, int]) -> MaskedBatch:
    """B rows of T random tokens between [CLS] and [SEP] (no padding), masked with BERT's 15% / 80-10-10."""
    cls, sep, pad = specials
    info = TokenizerInfo(mask_token_id=mask_id, vocab_size=vocab, special_ids=(cls, sep, pad, mask_id),
                         pad_token_id=pad)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(b):
        ids = [cls] + torch.randint(max(specials + (mask_id,)) + 1, vocab, (t - 2,), generator=gen).tolist() + [sep]
        special = [True] + [False] * (t - 2) + [True]
        rows.append((ids, *mask_sequence(ids, special, i, BertMasking(seed=0), info)))
    original = torch.tensor([r[0] for r in rows])
    inputs = torch.tensor([r[1] for r in rows])
    labels = torch.tensor([r[2] for r in rows])
    roles = torch.tensor([r[3] for r in rows], dtype=torch.int8)
    return MaskedBatch(inputs, original, labels, roles, torch.ones_like(inputs), torch.arange(b))


def shapes(names: list[str]) -> list[tuple[str, torch.nn.Module, MaskedBatch]]:
    out = []
    if "mini" in names:
        loaded = load_model("gradflow-mini-en")
        tok = loaded.tokenizer
        batch = make_batch(16, 128, len(tok), tok.mask_token_id, (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id))
        out.append(("gradflow-mini-en (B=16, T=128)", loaded.model, batch))
    if "base" in names:
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig())
        out.append(("bert-base shape (B=8, T=128)", model, make_batch(8, 128, 30522, 103, (101, 102, 0))))
    return out


def predicted(model: torch.nn.Module, batch: MaskedBatch) -> dict[str, float]:
    """gradflow check's FLOP count of this model and batch, and the step saving it predicts per mode."""
    flops = check_batch(model.eval(), batch).flops
    dense = flops.total + flops.head_unselected
    return {"share": flops.share, "share_with_attention": flops.share_with_attention,
            "head": flops.head_unselected / dense,
            "block": (flops.head_unselected + flops.skippable + flops.skippable_attention) / dense}


def train_step(mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: MaskedBatch) -> None:
    if mode == "dense":
        loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
    else:
        loss = sparse_mlm(model, block=mode == "block").loss(batch.input_ids, batch.attention_mask, batch.labels)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sync(device: str) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; a timer must not stop before it)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure(model: torch.nn.Module, batch: MaskedBatch, rounds: int, steps: int,
            device: str = "cpu") -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and process-CPU seconds per step of each mode, one value per round (modes interleaved; one
    warm-up step each). CPU time counts the work of every thread, so it is less sensitive to other load
    (on a GPU it is the host's time only: read the wall time there)."""
    model.to(device).train()
    batch = batch.to(device)
    for module in model.modules():  # dropout off: the same computation in every mode
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for mode in MODES:
        train_step(mode, model, opt, batch)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                train_step(mode, model, opt, batch)
            sync(device)
            times[mode].append((time.perf_counter() - start) / steps)
            cpu[mode].append((time.process_time() - start_cpu) / steps)
    return times, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps per mode per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="mini,base")
    p.add_argument("--json", action="store_true", help="also print one JSON line per shape")
    p.add_argument("--device", default="cpu", help="torch device of the training steps: cpu, cuda, cuda:N (default cpu)")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; leave --device out to measure on the CPU.")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"device {args.device} ({device}), torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    for name, model, batch in shapes(args.shapes.split(",")):
        print(f"\n{name}: starting at load average {os.getloadavg()[0]:.1f}", flush=True)
        tokens = int(batch.attention_mask.sum())
        loss_tokens = int((batch.labels != -100).sum())
        pred = predicted(model, batch)
        times, cpu = measure(model, batch, args.rounds, args.steps, args.device)
        median = {m: statistics.median(v) for m, v in times.items()}
        median_cpu = {m: statistics.median(v) for m, v in cpu.items()}
        print(f"\n{name}: {tokens} tokens, {loss_tokens} loss positions")
        print(f"  gradflow check: skippable share {pred['share']:.1%} (with attention rows "
              f"{pred['share_with_attention']:.1%})")
        for mode in MODES:
            speedup = median["dense"] / median[mode]
            saving = "" if mode == "dense" else (f", measured time saving {1 - 1 / speedup:.1%}, predicted FLOP "
                                                 f"saving {pred[mode]:.1%}")
            print(f"  {mode:5s}: {tokens / median[mode]:8.0f} tokens/s  step {median[mode]:.3f} s  "
                  f"[{min(times[mode]):.3f}-{max(times[mode]):.3f}]  speed-up {speedup:.3f}x{saving}; CPU time "
                  f"{median_cpu[mode]:.3f} s/step, speed-up {median_cpu['dense'] / median_cpu[mode]:.3f}x")
        if args.json:
            print(json.dumps({"shape": name, "tokens": tokens, "times": times, "cpu": cpu, "predicted": pred,
                              "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
