"""Sparse training under masked diffusion vs BERT's 15%: tokens/s of dense and sparse steps on a LLaDA-shaped model.

A LLaDA-shaped model is built from the imitation of LLaDA's remote code in ``tests/models/remote_code/llada_tiny``
(copied with a config into a temporary checkpoint directory and loaded through ``AutoModel`` with
``trust_remote_code``, as a real LLaDA checkpoint loads), at benchmark size: 6 blocks, d_model 256, 4 heads, FFN
704, vocabulary 8,192, B=16 sequences of T=128 tokens (<|startoftext|> ... <|endoftext|>, no padding), random weights.
Two batches of the same tokens, side by side in one run:

- ``diffusion``: LLaDA's pre-training objective (:class:`gradflow.inputs.objectives.MaskedDiffusion`, t ~ U(eps, 1)
  per sequence, every selected token masked, 1/t weights, the real-token normaliser): about half the positions
  carry loss;
- ``bert15``: BERT's 15% / 80-10-10 (:class:`gradflow.BertMasking`), the plain mean.

A training step is forward + loss + backward + AdamW step + zero_grad. Modes: ``dense`` (the whole model's
logits and ``gradflow.losses.get_loss("mlm", "batch")``: the objective's own loss) and ``sparse``
(:func:`gradflow.training.sparse_mlm`: the last block's query side, ``ln_f`` and the output layer at the loss
positions only; LLaDA's base model returns logits, so the head-only mode is refused). Modes and objectives are
interleaved within each round (median per mode). Beside each measured saving, ``gradflow check``'s FLOP shares for
the same model and batch (:func:`gradflow.runs.check.check_batch`): the skippable share (the last block's
zero-context Linear sublayers at the unselected positions, of the total), with the attention rows, and the step
saving those predict (``check_flops`` counts LLaDA's output layer, inside its base model, as the head:
``HeadSpec.in_base_model``). Not a test: numbers are printed, never asserted.

    OMP_WAIT_POLICY=passive python benchmarks/bench_sparse_objectives.py [--rounds 3] [--steps 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gradflow import BertMasking
from gradflow.inputs.batch import MaskedBatch, pad_draws
from gradflow.inputs.masking import TokenizerInfo, draw_sequence
from gradflow.inputs.objectives import MaskedDiffusion
from gradflow.losses import get_loss
from gradflow.runs.check import check_batch
from gradflow.training import sparse_mlm

CODE = Path(__file__).resolve().parents[1] / "tests" / "models" / "remote_code" / "llada_tiny"
MODES = ("dense", "sparse")
OBJECTIVES = {"diffusion": MaskedDiffusion(seed=0), "bert15": BertMasking(seed=0)}


def llada_model(layers: int, d_model: int, heads: int, ffn: int, vocab: int, length: int) -> torch.nn.Module:
    """A random LLaDA-shaped ``LLaDAModelLM`` loaded through AutoModel from a temporary remote-code checkpoint."""
    from transformers import AutoConfig, AutoModel

    folder = Path(tempfile.mkdtemp(prefix="bench_llada_"))
    try:
        for source in CODE.glob("*.py"):
            shutil.copy(source, folder / source.name)
        config = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": d_model, "n_heads": heads,
                  "n_kv_heads": heads, "n_layers": layers, "mlp_hidden_size": ffn, "vocab_size": vocab,
                  "embedding_size": vocab, "max_sequence_length": length, "weight_tying": False,
                  "include_bias": False, "mask_token_id": vocab - 1, "pad_token_id": 0, "eos_token_id": 0,
                  "bos_token_id": 1, "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                                                  "AutoModel": "modeling_llada.LLaDAModelLM"}}
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
        torch.manual_seed(0)
        return AutoModel.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=True),
                                     trust_remote_code=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def make_batch(policy, b: int, t: int, vocab: int) -> MaskedBatch:
    """B rows of T tokens (<|startoftext|> = 1, random ordinary tokens, <|endoftext|> = 0; the same tokens for
    every policy), masked by ``policy``; the mask token is the last id."""
    info = TokenizerInfo(mask_token_id=vocab - 1, vocab_size=vocab, special_ids=(0, 1, vocab - 1), pad_token_id=0)
    gen = torch.Generator().manual_seed(0)
    originals, draws = [], []
    for i in range(b):
        ids = [1] + torch.randint(2, vocab - 1, (t - 2,), generator=gen).tolist() + [0]
        originals.append(ids)
        draws.append(draw_sequence(ids, [True] + [False] * (t - 2) + [True], i, policy, info))
    return pad_draws(draws, originals, range(b), 0, weighted=isinstance(policy, MaskedDiffusion), shifted=False,
                     mean_over_sequences=False)


def predicted(model: torch.nn.Module, batch: MaskedBatch) -> dict[str, float]:
    """gradflow check's FLOP shares for this batch and the step saving they predict: a dense step runs the head at
    every position (``total + head_unselected``), the sparse one skips ``head_unselected`` and the skippable rows."""
    flops = check_batch(model.eval(), batch).flops
    skipped = flops.skippable + flops.skippable_attention
    return {"share": flops.share, "share_with_attention": flops.share_with_attention,
            "step": (flops.head_unselected + skipped) / (flops.total + flops.head_unselected)}


def train_step(mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: MaskedBatch) -> None:
    if mode == "dense":
        loss = get_loss("mlm", "batch")(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                                        batch)
    else:
        loss = sparse_mlm(model).batch_loss(batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure(model: torch.nn.Module, batches: dict[str, MaskedBatch], rounds: int, steps: int, device: str) -> dict:
    """Wall and process-CPU seconds per step of each (objective, mode), one value per round, all interleaved."""
    model.to(device).train()
    batches = {name: batch.to(device) for name, batch in batches.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    keys = [(name, mode) for name in batches for mode in MODES]
    for name, mode in keys:  # warm-up
        train_step(mode, model, opt, batches[name])
    wall: dict = {k: [] for k in keys}
    cpu: dict = {k: [] for k in keys}
    for _ in range(rounds):
        for name, mode in keys:
            sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                train_step(mode, model, opt, batches[name])
            sync(device)
            wall[(name, mode)].append((time.perf_counter() - start) / steps)
            cpu[(name, mode)].append((time.process_time() - start_cpu) / steps)
    return {"wall": wall, "cpu": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps per mode per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="also print the measurements as one JSON line")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; leave --device out to measure on the CPU.")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"device {args.device}, torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds x "
          f"{args.steps} steps, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    model = llada_model(args.layers, args.d_model, 4, args.d_model * 11 // 4, args.vocab, max(args.length, 256))
    for module in model.modules():  # dropout off: the same computation in every mode
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batches = {name: make_batch(policy, args.batch, args.length, args.vocab) for name, policy in OBJECTIVES.items()}
    pred = {name: predicted(model, batch) for name, batch in batches.items()}
    print(f"LLaDA shape: {args.layers} blocks, d_model {args.d_model}, vocabulary {args.vocab}, B={args.batch}, "
          f"T={args.length}; measuring at load average {os.getloadavg()[0]:.1f}", flush=True)
    times = measure(model, batches, args.rounds, args.steps, args.device)
    print(f"finished at load average {os.getloadavg()[0]:.1f}\n")
    print("| objective | loss positions | mode | tokens/s | speed-up (wall) | speed-up (CPU) | step saving "
          "measured (wall / CPU) | check: skippable share (with attention rows) | predicted step saving "
          "(check) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, batch in batches.items():
        tokens = int(batch.attention_mask.sum())
        loss_tokens = int((batch.labels != -100).sum())
        med = {m: statistics.median(times["wall"][(name, m)]) for m in MODES}
        med_cpu = {m: statistics.median(times["cpu"][(name, m)]) for m in MODES}
        for mode in MODES:
            speed, speed_cpu = med["dense"] / med[mode], med_cpu["dense"] / med_cpu[mode]
            cells = [name if mode == "dense" else "", f"{loss_tokens} of {tokens}" if mode == "dense" else "", mode,
                     f"{tokens / med[mode]:,.0f}", f"{speed:.2f}x", f"{speed_cpu:.2f}x"]
            if mode == "dense":
                cells += ["", "", ""]
            else:
                q = pred[name]
                cells += [f"{1 - 1 / speed:.1%} / {1 - 1 / speed_cpu:.1%}",
                          f"{q['share']:.1%} ({q['share_with_attention']:.1%})", f"{q['step']:.1%}"]
            print("| " + " | ".join(cells) + " |")
    if args.json:
        print(json.dumps({"predicted": pred, "wall": {f"{k[0]}/{k[1]}": v for k, v in times["wall"].items()},
                          "cpu": {f"{k[0]}/{k[1]}": v for k, v in times["cpu"].items()}, "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
