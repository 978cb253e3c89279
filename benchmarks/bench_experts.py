"""Cost of the experts' per-role split, measured side by side: a recorded step vs a bare forward+backward.

Prints, for a random OLMoE-shaped model (``--layers`` blocks of hidden ``--hidden``, ``--experts`` experts of
width ``--inner``, top-``--top-k``; B = ``--batch``, T = ``--length``), the median over interleaved rounds of:

- bare:  forward + MLM loss + ``loss.backward()``
- norms: the same under ``rec.capture`` with site norms only
- full:  the same under ``rec.capture`` with the per-role sublayer split (attention, router, experts)
- dense: the same split with the experts left out (their weight gradients autograd's, unsplit): ``full - dense`` is
  what splitting the experts costs, ``dense - bare`` what the rest of the recorder costs at this shape

and each one's ratio to bare (``paired``: the median over rounds of the ratio to the same round's bare step), then
the peak-memory ratio of each mode, each measured in a fresh subprocess (CPU: peak RSS above the loaded model;
CUDA: ``max_memory_allocated``), and the peak of the tensors one warm step creates (``PeakLiveTensors``: the same on
every run, where a small step's RSS moves by about 0.1 between fresh processes). ``--implementation`` picks the
experts implementation transformers runs (eager, batched_mm, grouped_mm) in ``bare``, ``norms`` and ``dense``; under ``full`` gradflow runs the experts itself (each expert's
rows in one product, :mod:`gradflow.hooks.split_experts`), or with ``--recompute`` the model's implementation runs
and the split recomputes the products it needs. Targets (issue 61): full <= 1.15x time, <= 1.10x memory. Numbers are printed, never
asserted.

    python benchmarks/bench_experts.py [--dtype float32|bfloat16] [--implementation grouped_mm] [--rounds 5]
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

import torch
from transformers import AutoModelForCausalLM, OlmoeConfig

from dataclasses import replace

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import adapter_for
from gradflow.inputs.masking import MaskedBatch
from gradflow.roles import Role
from peak_memory import PeakLiveTensors, PeakMemory  # benchmarks/peak_memory.py, beside this script

MODES = ("bare", "norms", "dense", "full")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(args):
    """The seeded random OLMoE-shaped model, in ``args.dtype`` on ``args.device``, eval mode."""
    config = OlmoeConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.inner,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, max_position_embeddings=args.length, pad_token_id=0)
    config._experts_implementation = args.implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 0.05)  # a router that spreads the rows over the experts
    return model.to(device=args.device, dtype=DTYPES[args.dtype])


def make_batch(args) -> MaskedBatch:
    """15% masked positions (80/10/10), the first position special, no padding."""
    gen = torch.Generator().manual_seed(0)
    b, t = args.batch, args.length
    ids = torch.randint(5, 1024, (b, t), generator=gen)
    draw = torch.rand(b, t, generator=gen)
    roles = torch.full((b, t), int(Role.CONTEXT), dtype=torch.int8)
    roles[draw < 0.15] = Role.MASKED
    roles[draw < 0.015] = Role.RANDOM
    roles[(draw >= 0.015) & (draw < 0.03)] = Role.KEPT
    roles[:, 0] = Role.SPECIAL
    inputs = torch.where(roles == Role.MASKED, torch.full_like(ids, 4), ids)
    labels = torch.where(roles <= Role.KEPT, ids, torch.full_like(ids, -100))
    batch = MaskedBatch(inputs, ids, labels, roles, torch.ones(b, t, dtype=torch.long), torch.arange(b))
    return batch.to(args.device)


def recorder_for(model, args, sublayers: bool, experts: bool = True) -> GradFlowRecorder:
    """The recorder of a mode; ``--recompute``: the model's own experts implementation runs and the split
    recomputes its products (``ExpertsSpec.own_forward=False``); ``experts=False``: the experts are not split."""
    adapter = adapter_for(model)
    if not experts:
        adapter = replace(adapter, experts={})
    elif args.recompute:
        adapter = replace(adapter, experts={n: replace(e, own_forward=False) for n, e in adapter.experts.items()})
    return GradFlowRecorder(model, RecorderConfig(sublayers=sublayers), adapter=adapter)


def recorder_for_mode(model, args, mode: str) -> GradFlowRecorder:
    """``norms``: site norms only; ``dense``: the split without the experts; ``full``: the whole split."""
    return recorder_for(model, args, mode != "norms", experts=mode != "dense")


def step(mode: str, model, batch, recorder) -> None:
    if mode == "bare":
        mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    else:
        with recorder.capture(batch.roles):
            mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
        recorder.result()
    model.zero_grad(set_to_none=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timing(args) -> dict[str, list[float]]:
    model, batch = build(args), make_batch(args)
    recorders = {mode: recorder_for_mode(model, args, mode) for mode in MODES if mode != "bare"}
    times = {m: [] for m in MODES}
    step("bare", model, batch, None)
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else tuple(reversed(MODES)):
            recorder = recorders.get(mode)
            with recorder if recorder is not None else contextlib.nullcontext():
                step(mode, model, batch, recorder)  # warm this mode's paths
                sync(args.device)
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(mode, model, batch, recorder)
                sync(args.device)
            times[mode].append((time.perf_counter() - start) / args.steps)
    return times


def memory_one(args, mode: str) -> float:
    """Peak memory of one step of ``mode`` above the loaded model and batch (MiB)."""
    model, batch = build(args), make_batch(args)
    recorder = None if mode == "bare" else recorder_for_mode(model, args, mode)
    with PeakMemory(args.device) as peak, recorder if recorder is not None else contextlib.nullcontext():
        step(mode, model, batch, recorder)
    return peak.mib


def live_peaks(args) -> dict[str, float]:
    """Per mode, the peak MiB of the tensors one warm step creates (:class:`PeakLiveTensors`: deterministic)."""
    model, batch = build(args), make_batch(args)
    peaks = {}
    for mode in MODES:
        recorder = None if mode == "bare" else recorder_for_mode(model, args, mode)
        with recorder if recorder is not None else contextlib.nullcontext():
            step(mode, model, batch, recorder)
            with PeakLiveTensors() as live:
                step(mode, model, batch, recorder)
        peaks[mode] = live.mib
    return peaks


def profile(args) -> None:
    """``--profile MODE``: one warm step of MODE under torch.profiler; the ops by self CPU time and the op count."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    model, batch = build(args), make_batch(args)
    recorder = None if args.profile == "bare" else recorder_for_mode(model, args, args.profile)
    with recorder if recorder is not None else contextlib.nullcontext():
        step(args.profile, model, batch, recorder)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step(args.profile, model, batch, recorder)
    events = prof.key_averages()
    print(f"{args.profile}: {sum(e.count for e in events)} ops, self CPU {sum(e.self_cpu_time_total for e in events) / 1e3:.1f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode and round (their mean is the sample)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inner", type=int, default=512, help="each expert's intermediate width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--implementation", default="grouped_mm", choices=("eager", "batched_mm", "grouped_mm"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--recompute", action="store_true", help="the model's experts implementation runs during the "
                   "capture; the split recomputes the products it needs (default: gradflow runs the experts)")
    p.add_argument("--profile", default=None, choices=MODES, help="profile one step of this mode (no timing)")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        profile(args)
        return
    if args.memory_child:
        print(json.dumps({"peak_mib": memory_one(args, args.memory_child)}))
        return
    print(f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} layers={args.layers} "
          f"hidden={args.hidden} inner={args.inner} experts={args.experts} top_k={args.top_k} B={args.batch} "
          f"T={args.length} experts_implementation={args.implementation} "
          f"split={'recompute' if args.recompute else 'gradflow-forward'} torch={torch.__version__} "
          f"load={os.getloadavg()[0]:.2f}")
    times = timing(args)
    bare = statistics.median(times["bare"])
    print(f"{'mode':<8}{'median s':>10}{'ratio':>8}{'paired':>8}   (interleaved, {args.rounds} rounds of {args.steps} "
          "steps)")
    for mode in MODES:
        med = statistics.median(times[mode])
        paired = statistics.median(t / b for t, b in zip(times[mode], times["bare"]))
        print(f"{mode:<8}{med:>10.4f}{med / bare:>8.3f}{paired:>8.3f}")
    peaks = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--memory-child", mode] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("memory_child", "rounds", "steps", "recompute") and v is not None]
        cmd += ["--recompute"] if args.recompute else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        peaks[mode] = json.loads(out)["peak_mib"]
    print(f"{'mode':<8}{'peak MiB':>10}{'ratio':>8}   (one step, fresh process each, above the loaded model)")
    for mode in MODES:
        print(f"{mode:<8}{peaks[mode]:>10.1f}{peaks[mode] / peaks['bare']:>8.3f}")
    live = live_peaks(args)
    print(f"{'mode':<8}{'live MiB':>10}{'ratio':>8}   (one warm step: the peak of the tensors it creates, deterministic)")
    for mode in MODES:
        print(f"{mode:<8}{live[mode]:>10.1f}{live[mode] / live['bare']:>8.3f}")


if __name__ == "__main__":
    main()
