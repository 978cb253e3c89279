"""Recorder overhead, measured side by side: recorded step vs a bare forward+backward.

Prints, for a bert-base-shaped random BertForMaskedLM (12 layers, hidden 768, 12 heads, FFN 3072;
B=8, T=128 by default), the median over interleaved rounds of:

- bare:        forward + MLM loss + ``loss.backward()``
- norms:       the same under ``rec.capture`` with site norms only
- full:        the same under ``rec.capture`` with the per-role sublayer split
- record-norms / record-full: ``rec.record()`` (``autograd.grad`` to the embeddings; no ``.grad``)
- captum-norms: Captum's ``compute_layer_gradients_and_eval`` over the same sites (the embeddings,
  each block's mid point and output), then the per-position norms of its gradients and outputs: the
  same numbers as record-norms, the way a Captum user gets them

and each one's ratio to bare (``ratio``: of the medians; ``paired``: the median over rounds of the ratio
to the same round's bare step, less sensitive to a host whose speed drifts; each mode's sample: the mean
of ``--steps`` steps after one untimed step of the same mode), with the CPU time ratio beside it; then
the peak-memory ratio of each mode, each measured in a fresh subprocess (CPU: peak RSS above the loaded
model; CUDA: ``max_memory_allocated``). Targets (issue 29): full <= 1.10x, record-full <= 1.0x,
record-norms <= captum-norms, memory <= 1.10x. Not a test: numbers are printed, never asserted.

    python benchmarks/bench_recorder.py [--rounds 5] [--steps 3] [--device cpu|cuda] [--dtype bfloat16|float16] [--layers 12]
                                        [--objective bert|mask40|span|diffusion] [--shift] [--ops]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import torch
from transformers import BertConfig, BertForMaskedLM

from gradflow import BertMasking, GradFlowRecorder, MaskedDiffusion, RecorderConfig, SpanMasking, mlm_loss
from gradflow.inputs.batch import pad_draws
from gradflow.inputs.masking import MaskedBatch, TokenizerInfo, draw_sequence
from peak_memory import PeakMemory  # benchmarks/peak_memory.py, beside this script

MODES = ("bare", "norms", "full", "record-norms", "record-full", "captum-norms")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""float16: for a GPU (a CPU without float16 arithmetic runs its products 100x slower than bfloat16's)."""


def build(layers: int, device: str, dtype: str = "float32", seed: int = 0):
    """The seeded random bert-base-shaped model, weights in ``dtype``, on ``device``, in eval mode."""
    torch.manual_seed(seed)
    config = BertConfig(num_hidden_layers=layers)
    model = BertForMaskedLM(config).to(device=device, dtype=DTYPES[dtype]).eval()
    return model


OBJECTIVES = {"bert": BertMasking(seed=0), "mask40": BertMasking(rate=0.4, seed=0), "span": SpanMasking(seed=0),
              "diffusion": MaskedDiffusion(seed=0)}
"""``--objective``: the masking of the benchmark batch (diffusion: t ~ U(0.001, 1) per sequence, 1/t weights)."""


def make_batch(b: int, t: int, vocab: int, device: str, objective: str = "bert", shift: bool = False) -> MaskedBatch:
    """B random sequences of T tokens ([CLS] ... [SEP]) masked by ``objective`` (shifted with ``shift``)."""
    info = TokenizerInfo(mask_token_id=103, vocab_size=vocab, special_ids=(0, 100, 101, 102, 103), pad_token_id=0)
    gen = torch.Generator().manual_seed(0)
    policy = replace(OBJECTIVES[objective], shift=shift)
    originals, draws = [], []
    for i in range(b):
        ids = [101] + torch.randint(1000, vocab, (t - 2,), generator=gen).tolist() + [102]
        special = [True] + [False] * (t - 2) + [True]
        originals.append(ids)
        draws.append(draw_sequence(ids, special, i, policy, info))
    batch = pad_draws(draws, originals, range(b), 0, weighted=isinstance(policy, MaskedDiffusion), shifted=shift,
                      mean_over_sequences=False)
    return batch.to(device)


def site_modules(model) -> list[torch.nn.Module]:
    """The modules whose outputs are the recorder's sites in this BERT: the embeddings, each layer's
    attention output (``attention.output``: the tensor BertAttention returns first) and each layer."""
    modules = [model.bert.embeddings]
    for layer in model.bert.encoder.layer:
        modules += [layer.attention.output, layer]
    return modules


def captum_norms(model, batch) -> list[torch.Tensor]:
    """Captum's gradients and outputs at every site, reduced to (B, T) norms as the recorder keeps them."""
    from captum._utils.gradient import compute_layer_gradients_and_eval

    def forward(input_ids, attention_mask):
        return mlm_loss(model(input_ids=input_ids, attention_mask=attention_mask).logits, batch).reshape(1)

    grads, outputs = compute_layer_gradients_and_eval(forward, site_modules(model), (batch.input_ids,),
                                                      additional_forward_args=(batch.attention_mask,))
    return [t[0].norm(dim=-1) for t in (*grads, *outputs)]


def step(mode: str, model, batch, recorders) -> None:
    if mode == "bare":
        mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    elif mode == "captum-norms":
        captum_norms(model, batch)
    elif mode in ("norms", "full"):
        with recorders[mode].capture(batch.roles):
            mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
        recorders[mode].result()
    else:
        recorders[mode.split("-")[1]].record(batch)
    model.zero_grad(set_to_none=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timing(args) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per mode, the wall and CPU seconds per step of each round: every mode alike takes one untimed step,
    then ``args.steps`` timed steps whose mean is the round's sample (one step alone varies by several
    percent on a shared 2-core machine; the mean of a few does not)."""
    model = build(args.layers, args.device, args.dtype)
    batch = make_batch(args.batch, args.length, model.config.vocab_size, args.device, args.objective, args.shift)
    times = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}
    norms = GradFlowRecorder(model, RecorderConfig(sublayers=False))
    full = GradFlowRecorder(model, RecorderConfig(sublayers=True))
    for _ in range(args.warmup):
        step("bare", model, batch, {})
    for round_ in range(args.rounds):
        order = MODES if round_ % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            recorder = full if "full" in mode else norms if "norms" in mode and mode != "captum-norms" else None
            with recorder if recorder is not None else contextlib.nullcontext():
                recorders = {"norms": recorder, "full": recorder}
                step(mode, model, batch, recorders)  # warm this mode's paths
                sync(args.device)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    step(mode, model, batch, recorders)
                sync(args.device)
            times[mode].append((time.perf_counter() - t0) / args.steps)
            cpu[mode].append((time.process_time() - c0) / args.steps)
    return times, cpu


def memory_one(args, mode: str) -> float:
    """Peak memory of one step of ``mode`` above the loaded model and batch (MiB)."""
    model = build(args.layers, args.device, args.dtype)
    batch = make_batch(args.batch, args.length, model.config.vocab_size, args.device, args.objective, args.shift)
    recorder = None
    if mode not in ("bare", "captum-norms"):
        recorder = GradFlowRecorder(model, RecorderConfig(sublayers="full" in mode))
    with PeakMemory(args.device) as peak:
        if recorder is None:
            step(mode, model, batch, {})
        else:
            with recorder:
                step(mode, model, batch, {"norms": recorder, "full": recorder})
    return peak.mib


def ops_per_step(args) -> dict[str, int]:
    """Per mode (bare, norms, full), the aten operations one step dispatches (after a warm step): the count of
    small operations behind the statistics' cost where a step is short (bfloat16), independent of the machine."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    model = build(args.layers, args.device, args.dtype)
    batch = make_batch(args.batch, args.length, model.config.vocab_size, args.device, args.objective, args.shift)
    counts = {}
    for mode in ("bare", "norms", "full"):
        recorder = GradFlowRecorder(model, RecorderConfig(sublayers=mode == "full")) if mode != "bare" else None
        with recorder if recorder is not None else contextlib.nullcontext():
            step(mode, model, batch, {mode: recorder})
            Count.n = 0
            with Count():
                step(mode, model, batch, {mode: recorder})
        counts[mode] = Count.n
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode and round (their mean is the sample)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the model's weights (default float32)")
    p.add_argument("--objective", default="bert", choices=sorted(OBJECTIVES),
                   help="the batch's masking: bert 15%%, mask40, span, diffusion (t ~ U(0.001, 1), 1/t weights)")
    p.add_argument("--shift", action="store_true", help="a shifted objective (logits at p predict p + 1)")
    p.add_argument("--ops", action="store_true", help="also count the aten operations one step dispatches per mode")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps({"peak_mib": memory_one(args, args.memory_child)}))
        return
    print(f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} layers={args.layers} "
          f"B={args.batch} T={args.length} objective={args.objective}{' shifted' if args.shift else ''} "
          f"torch={torch.__version__} load={os.getloadavg()[0]:.2f}")
    times, cpu = timing(args)
    bare, bare_cpu = statistics.median(times["bare"]), statistics.median(cpu["bare"])
    print(f"{'mode':<14}{'median s':>10}{'ratio':>8}{'min':>8}{'max':>8}{'paired':>8}{'cpu ratio':>11}   "
          f"(interleaved, {args.rounds} rounds of {args.steps} steps)")
    for mode in MODES:
        med = statistics.median(times[mode])
        paired = statistics.median(t / b for t, b in zip(times[mode], times["bare"]))  # same round's bare
        print(f"{mode:<14}{med:>10.3f}{med / bare:>8.3f}{min(times[mode]) / bare:>8.3f}{max(times[mode]) / bare:>8.3f}"
              f"{paired:>8.3f}{statistics.median(cpu[mode]) / bare_cpu:>11.3f}")
    print(f"load={os.getloadavg()[0]:.2f} after timing")
    if args.ops:
        counts = ops_per_step(args)
        print("aten operations per step: " + ", ".join(f"{m} {n:,}" for m, n in counts.items()))
    peaks = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--memory-child", mode, "--layers", str(args.layers), "--batch",
               str(args.batch), "--length", str(args.length), "--device", args.device, "--dtype", args.dtype,
               "--objective", args.objective] + (["--shift"] if args.shift else [])
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        peaks[mode] = json.loads(out)["peak_mib"]
    print(f"{'mode':<14}{'peak MiB':>10}{'ratio':>8}   (one step, fresh process each, above the loaded model)")
    for mode in MODES:
        print(f"{mode:<14}{peaks[mode]:>10.1f}{peaks[mode] / peaks['bare']:>8.3f}")


if __name__ == "__main__":
    main()
