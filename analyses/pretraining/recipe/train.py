"""The training loop: resume, fixed-interval and on-signal checkpoints, a wall-time limit, the curve.

Exit codes of ``run`` (and of ``pretrain_base.py``):
- ``EXIT_DONE`` (0): all steps trained; final model, tokenizer, curve and meta.json written.
- ``EXIT_STOPPED`` (75, EX_TEMPFAIL): stopped early with a checkpoint (SIGTERM / SIGINT,
  ``--max-minutes`` or the ``--stop-after`` hook); rerunning the same command resumes.
- ``EXIT_CONFIG`` (2): refused (the checkpoint's config differs from the arguments, or no corpus).
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .checkpoint import load_checkpoint, save_checkpoint, set_rng_state
from .config import RunConfig, identity_diff
from .data import Batch, SpecialIds, TokenStream, file_sha256, get_tokenizer, load_windows, validation_batches
from .model import autocast, build_model, mlm_loss, sparse_mlm_loss
from .snapshots import snapshot_steps, write_snapshot

EXIT_DONE, EXIT_CONFIG, EXIT_STOPPED = 0, 2, 75
CURVE_FIELDS = ["step", "tokens", "train_loss", "lr", "valid_loss", "valid_top1", "valid_positions", "elapsed_s"]
# columns that depend only on the run, not on when or in how many commands it was trained
CURVE_VALUE_FIELDS = CURVE_FIELDS[:-1]


class ConfigMismatch(RuntimeError):
    """The checkpoint in ``--out`` belongs to a different run."""


class StopRequest:
    """Set by SIGTERM / SIGINT; the loop finishes the current step, checkpoints, and exits."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = signum
        print(f"received {signal.Signals(signum).name}: finishing the current step, then checkpointing",
              flush=True)
        signal.signal(signum, signal.SIG_DFL)  # a second signal of the same kind kills at once

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def make_optimizer(model: torch.nn.Module, cfg: RunConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (betas 0.9/0.98, eps 1e-6; no decay on biases and norms), linear warm-up then linear decay to 0."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)

    def factor(step: int) -> float:
        return min((step + 1) / cfg.warmup, max(0.0, (cfg.steps - step) / (cfg.steps - cfg.warmup)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
               batch: Batch, cfg: RunConfig) -> torch.Tensor:
    """One optimiser step on a batch already on the device; returns the (detached) loss."""
    with autocast(cfg):
        loss = sparse_mlm_loss(model, batch) if cfg.sparse else mlm_loss(model, batch)[0]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    opt.step()
    schedule.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Batch], cfg: RunConfig) -> dict[str, float]:
    """Loss and top-1 accuracy at the selected (15%) positions of the fixed validation masking."""
    model.eval()
    total_loss = correct = count = 0.0
    for batch in batches:
        with autocast(cfg):
            loss, logits, targets = mlm_loss(model, batch.to(cfg.device))
        n = targets.numel()
        total_loss += float(loss) * n
        correct += float((logits.argmax(-1) == targets).sum())
        count += n
    model.train()
    return {"valid_loss": total_loss / max(count, 1), "valid_top1": correct / max(count, 1),
            "valid_positions": int(count)}


def versions() -> dict[str, str]:
    """Versions of the pieces that change numbers."""
    import tokenizers
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "numpy": np.__version__,
            "cuda": torch.version.cuda or "", "platform": platform.platform()}


def write_curve(path: Path, curve: list[dict[str, object]]) -> None:
    """The loss curve as CSV (columns ``CURVE_FIELDS``; validation cells empty off evaluation steps)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CURVE_FIELDS)
        writer.writeheader()
        writer.writerows(curve)
    os.replace(tmp, path)


def write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def run(cfg: RunConfig, argv: list[str] | None = None) -> int:
    """Train (or resume) the run ``cfg`` until done or stopped; return an exit code (module docstring). Torch's
    thread count is ``cfg.threads`` while it runs and the caller's again after."""
    threads = torch.get_num_threads()
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        return _run(cfg, argv)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: RunConfig, argv: list[str] | None) -> int:
    t0 = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")

    state = load_checkpoint(out)
    if state is not None:
        differences = identity_diff(state["config"], cfg.identity())
        if differences:
            raise ConfigMismatch(
                f"{out / 'checkpoint.pt'} was written by a run with a different config "
                f"(stored -> now): {'; '.join(differences)}. Rerun with the original arguments to resume, "
                "or choose a new --out to start a new run.")

    corpus = Path(cfg.corpus)
    tok_dir = Path(cfg.tokenizer) if cfg.tokenizer else out / "tokenizer"
    tokenizer = get_tokenizer(corpus, tok_dir, cfg.vocab_size)
    tok_hash = file_sha256(tok_dir / "tokenizer.json")
    if state is not None and state["tokenizer_sha256"] != tok_hash:
        raise ConfigMismatch(f"the tokenizer in {tok_dir} is not the one the checkpoint was trained with "
                             "(tokenizer.json hash differs); pass the run's original --tokenizer")
    special = SpecialIds.of(tokenizer)
    train_windows = load_windows(tokenizer, corpus / "train.txt", cfg.max_len, out / "cache")
    valid_windows = load_windows(tokenizer, corpus / "valid.txt", cfg.max_len, out / "cache")
    # head rows per step: every position for the all-token loss, else 1/4 of them (15% are selected)
    capacity = cfg.batch_size * cfg.max_len if cfg.loss == "alltoken" else cfg.batch_size * cfg.max_len // 4
    stream = TokenStream(train_windows, cfg.batch_size, cfg.seed, special, cfg.loss == "alltoken", capacity)
    valid = validation_batches(valid_windows, cfg.valid_windows, cfg.seed, special)

    model = build_model(cfg, len(tokenizer), special.pad)
    opt, schedule = make_optimizer(model, cfg)
    step, curve, tokens_seen = 0, [], 0
    segments: list[dict[str, object]] = []
    if state is not None:
        if state["data_position"]["train_windows"] != len(train_windows):
            raise ConfigMismatch(f"the corpus changed: the checkpoint saw {state['data_position']['train_windows']} "
                                 f"training windows, {corpus} now gives {len(train_windows)}")
        model.load_state_dict(state["model"])
        model.to(device)
        opt.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
        step, curve, tokens_seen = int(state["step"]), list(state["curve"]), int(state["tokens_seen"])
        segments = list(state["segments"])
        set_rng_state(state["rng"])
        print(f"resuming from step {step} of {cfg.steps} ({out / 'checkpoint.pt'})", flush=True)
    else:
        model.to(device)
        print(f"new run in {out}: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{len(train_windows)} train windows, {len(valid_windows)} valid windows", flush=True)
    del state
    segments.append({"start_step": step, "argv": argv or [], "device": cfg.device, "threads": torch.get_num_threads()})
    meta = {"config": asdict(cfg), "identity": cfg.identity(), "command_line": argv or [], "versions": versions(),
            "tokenizer": str(tok_dir), "tokenizer_sha256": tok_hash, "vocab_size": len(tokenizer),
            "train_windows": len(train_windows), "valid_windows": len(valid_windows),
            "parameters": sum(p.numel() for p in model.parameters()), "segments": segments,
            "exit_codes": {"done": EXIT_DONE, "config": EXIT_CONFIG, "stopped": EXIT_STOPPED}}
    write_json(out / "meta.json", meta)

    elapsed_before = float(curve[-1]["elapsed_s"]) if curve else 0.0
    seg_start, seg_cpu_start = time.monotonic(), time.process_time()

    def checkpoint() -> None:
        # this command's steps, wall and CPU seconds (every thread of the process; a paused process uses none)
        segments[-1].update(end_step=step, wall_s=round(time.monotonic() - seg_start, 1),
                            cpu_s=round(time.process_time() - seg_cpu_start, 1))
        save_checkpoint(out, {
            "config": cfg.identity(), "step": step, "data_position": stream.position(step), "tokens_seen": tokens_seen,
            "tokenizer_sha256": tok_hash, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": schedule.state_dict(),
            "curve": curve, "segments": segments,
        })
        write_curve(out / "training_log.csv", curve)
        write_json(out / "meta.json", meta)  # its segments as of this checkpoint

    snapshot_at = set(snapshot_steps(cfg.steps, cfg.snapshots))
    stop = StopRequest()
    stop.install()
    reason = ""
    try:
        model.train()
        while step < cfg.steps:
            batch = stream.batch(step)
            loss = train_step(model, opt, schedule, batch.to(device), cfg)
            step += 1
            tokens_seen += batch.tokens()
            loss_value = float(loss)
            row: dict[str, object] = {
                "step": step, "tokens": tokens_seen, "train_loss": loss_value, "lr": schedule.get_last_lr()[0],
                "elapsed_s": round(elapsed_before + time.monotonic() - seg_start, 2)}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                row.update(evaluate(model, valid, cfg))
            curve.append(row)
            if step % cfg.log_every == 0 or "valid_top1" in row:
                extra = f" valid_top1 {row['valid_top1']:.4f}" if "valid_top1" in row else ""
                print(f"step {step} loss {loss_value:.4f}{extra} elapsed {row['elapsed_s']}s", flush=True)
            if not math.isfinite(loss_value):
                checkpoint()
                raise SystemExit(f"non-finite loss at step {step}; checkpoint written")
            if step in snapshot_at:
                write_snapshot(out, model, step, tokens_seen)
            if cfg.throttle_s:
                time.sleep(cfg.throttle_s)
            if step % cfg.checkpoint_every == 0 and step < cfg.steps:
                checkpoint()
            if step >= cfg.steps:
                break
            if stop.signal is not None:
                reason = f"{signal.Signals(stop.signal).name} received"
            elif cfg.max_minutes is not None and time.monotonic() - t0 >= cfg.max_minutes * 60:
                reason = f"--max-minutes {cfg.max_minutes} reached"
            elif cfg.stop_after is not None and step >= cfg.stop_after:
                reason = f"--stop-after {cfg.stop_after} reached"
            if reason:
                checkpoint()
                print(f"stopped at step {step} of {cfg.steps} ({reason}); checkpoint written to "
                      f"{out / 'checkpoint.pt'}. Rerun the same command to resume. Exit code {EXIT_STOPPED}.",
                      flush=True)
                return EXIT_STOPPED
    finally:
        stop.uninstall()

    checkpoint()
    model.to("cpu").save_pretrained(out / "model", safe_serialization=True)
    tokenizer.save_pretrained(out / "model")
    final = {k: curve[-1][k] for k in ("valid_loss", "valid_top1", "valid_positions")} if curve else {}
    meta.update(final=final, tokens_seen=tokens_seen, steps_done=step)
    write_json(out / "meta.json", meta)
    print(f"done: {step} steps, final {json.dumps(final)}; model in {out / 'model'}", flush=True)
    return EXIT_DONE


def main_guard(cfg: RunConfig, argv: list[str]) -> int:
    """``run`` with the refusals turned into a message on stderr and ``EXIT_CONFIG``."""
    try:
        return run(cfg, argv)
    except ConfigMismatch as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
