"""Train the diagnosis cells (``figures/diffusion-diagnosis/plan.md``) and measure them while they train.

Each run trains one :class:`~analyses.diffusion_diagnosis.cells.Cell` from one seed for the first ``--steps`` steps
of its 3,059-step schedule (600 in the plan), in float32 unless ``--bf16``, and at every step of :data:`CHECKPOINTS` measures it:

- **with gradflow's own instruments** (:func:`gradflow.interventions.snapshot.training_snapshot`, in float32, on a
  fixed probe batch of 32 validation windows): the context/loss gradient-norm ratio by layer, the word-embedding
  matrix's gradient by position role, representation collapse and attention entropy, under two corruptions of the
  same windows: the cell's own (probe ``own``, its loss as trained, 1/t weights included) and every token masked
  with probability 0.15 (probe ``t0.15``, the mean loss at the masked positions: the same for every cell);
- **by prediction** (:func:`evaluate`): the acceptance measure, top-1 at the masked positions when every token of a
  held-out window is replaced by [MASK] with probability 0.15 (128 validation windows; 1,024 at the last step,
  with, on 256 windows, the cell's own loss, the top-1 at t = 0.5 and the BERT-15% top-1 of the first diagnostics).

A run writes ``<out>/<cell>-s<seed>.csv`` (the snapshots' rows: the callback log's columns and ``probe``) and then
``<out>/<cell>-s<seed>.json`` (its configuration, the evaluations per checkpoint, times); a run whose JSON exists is
skipped, so the sweep resumes where it stopped. ``--max-minutes`` starts no run after that many minutes;
a run in progress at ``--max-minutes`` keeps its state (:mod:`run_state`) and resumes on the next call.
``--worker i/n`` takes every n-th run (seed 0 of every cell before seed 1: a cut leaves whole seeds).

    python -m analyses.diffusion_diagnosis.train --out figures/diffusion-diagnosis/runs --worker 0/2 --max-minutes 100
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from analyses.diffusion_diagnosis import cells as cells_mod
from analyses.diffusion_diagnosis import run_state
from analyses.diffusion_diagnosis.cells import SCHEDULE_STEPS, WARMUP, Cell
from analyses.pretraining import objectives, pretrain
from gradflow.interventions.snapshot import training_snapshot

CHECKPOINTS = (0, 25, 50, 100, 150, 225, 300, 450, 600, 900, 1200, 1800, 2400, 3600, 4800, 7500)
"""The steps measured (0: the initial weights); the plan's cells train 600 steps, rule 4's fallback 3,059 (and the
last step always)."""
EVAL_WINDOWS, FINAL_WINDOWS, OWN_WINDOWS, PROBE_WINDOWS = 128, 1024, 256, 32
PROBE_T = 0.15
"""The acceptance corruption's t (and the common probe's)."""


def load_data(corpus: Path, tokenizer_dir: Path):
    """(tokenizer, train windows (N, 128), validation windows in the fixed order of seed 7 (M, 128))."""
    tokenizer = pretrain.train_tokenizer(corpus, tokenizer_dir, 8192)
    train = pretrain.windows(tokenizer, corpus / "train.txt")
    valid_all = pretrain.windows(tokenizer, corpus / "valid.txt")
    order = torch.randperm(len(valid_all), generator=torch.Generator().manual_seed(7))
    return tokenizer, train, valid_all[order]


def build(c: Cell, seed: int, tokenizer) -> torch.nn.Module:
    """The seeded mini-en-shaped RoFormer of cell ``c`` (untied and zero-initialised output as the cell says)."""
    args = argparse.Namespace(arch="roformer", dropout=0.0, position_init="sinusoidal", position_scale=1.0,
                              tie_embeddings=c.tied)
    torch.manual_seed(seed)
    model = pretrain.build_model(args, len(tokenizer), tokenizer.pad_token_id)
    if c.zero_output:
        head = model.get_output_embeddings()
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
    return model.train()


def optimizer(model: torch.nn.Module, c: Cell):
    """mini-en's AdamW; warm-up 212 steps, then linear decay to 0 at 3,059 steps or (``constant``) constant."""
    args = argparse.Namespace(lr=c.lr, warmup=WARMUP, steps=SCHEDULE_STEPS)
    opt, schedule = pretrain.make_optimizer(model, args)
    if c.constant:
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / WARMUP, 1.0))
    return opt, schedule


def cell_loss(model, batch: objectives.Corrupted, attention_mask: torch.Tensor) -> torch.Tensor:
    """The loss of ``batch`` as :func:`objectives.objective_loss` computes it (1/t weights when it has ratios)."""
    return objectives.objective_loss(model, batch, attention_mask)[0]


def snapshot_loss(ratio: torch.Tensor | None):
    """A :func:`training_snapshot` ``loss_fn`` computing :func:`cell_loss` with the windows' ratios ``ratio``."""
    def loss_fn(model, input_ids, attention_mask, labels):
        return cell_loss(model, objectives.Corrupted(input_ids, labels, labels != -100, ratio), attention_mask)
    return loss_fn


@torch.no_grad()
def masked_top1(model, tokenizer, valid: torch.Tensor, t: float, seed: int = 11, batch: int = 128,
                bf16: bool = False) -> dict:
    """Top-1 and mean cross-entropy (nats) at the masked positions of ``valid`` (N, 128), each non-special token
    replaced by [MASK] with probability ``t`` (:func:`cells.corrupt_at`, one generator seeded ``seed``)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    correct = loss = n = 0.0
    for start in range(0, len(valid), batch):
        ids = valid[start : start + batch]
        corrupted = cells_mod.unweighted(cells_mod.corrupt_at(ids, tokenizer, t, gen))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            mean, logits, targets = objectives.objective_loss(model, corrupted, (ids != tokenizer.pad_token_id).long())
        correct += float((logits.argmax(-1) == targets).sum())
        loss += float(mean) * targets.numel()
        n += targets.numel()
    model.train()
    return {"top1": correct / n, "loss": loss / n, "positions": int(n)}


@torch.no_grad()
def own_loss(model, c: Cell, tokenizer, valid: torch.Tensor, batch: int = 128, bf16: bool = False) -> float:
    """The cell's own loss on ``valid`` under a fixed corruption (generators seeded 12 and 13): per real token for
    diffusion (the 1/t-weighted sum over the masked positions), per loss position for bert15."""
    model.eval()
    gen, ratio_gen = torch.Generator().manual_seed(12), torch.Generator().manual_seed(13)
    total = norm = 0.0
    for start in range(0, len(valid), batch):
        ids = valid[start : start + batch]
        corrupted = cells_mod.corrupt(c, ids, tokenizer, gen, ratio_gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = cell_loss(model, corrupted, (ids != tokenizer.pad_token_id).long())
        weight = int((ids != tokenizer.pad_token_id).sum()) if corrupted.ratio is not None else int(
            (corrupted.labels != -100).sum())
        total += float(loss) * weight
        norm += weight
    model.train()
    return total / norm


@torch.no_grad()
def bert15_top1(model, tokenizer, valid: torch.Tensor, batch: int = 128, bf16: bool = False) -> float:
    """Top-1 at the selected positions of BERT-15% masking (80/10/10, generator seeded 1): the first diagnostics'
    measure (``pretrain.evaluate``'s corruption)."""
    model.eval()
    gen = torch.Generator().manual_seed(1)
    correct = n = 0.0
    for start in range(0, len(valid), batch):
        ids = valid[start : start + batch]
        corrupted = objectives.corrupt_bert(ids, tokenizer, gen, 0.15)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, logits, targets = objectives.objective_loss(model, corrupted, (ids != tokenizer.pad_token_id).long())
        correct += float((logits.argmax(-1) == targets).sum())
        n += targets.numel()
    model.train()
    return correct / n


def evaluate(model, c: Cell, tokenizer, valid: torch.Tensor, final: bool, bf16: bool = False) -> dict:
    """One checkpoint's prediction measures: all-[MASK] top-1 and loss at t = 0.15 on the first 128 windows of
    ``valid`` (1,024 when ``final``); when ``final`` also, on the first 256, the cell's own loss, the top-1 at
    t = 0.5 and the BERT-15% top-1."""
    at15 = masked_top1(model, tokenizer, valid[: FINAL_WINDOWS if final else EVAL_WINDOWS], PROBE_T, bf16=bf16)
    row = {"mask15_top1": at15["top1"], "mask15_loss": at15["loss"], "mask15_positions": at15["positions"]}
    if final:
        windows = valid[:OWN_WINDOWS]
        row["own_loss"] = own_loss(model, c, tokenizer, windows, bf16=bf16)
        row["mask50_top1"] = masked_top1(model, tokenizer, windows, 0.5, bf16=bf16)["top1"]
        row["bert15_top1"] = bert15_top1(model, tokenizer, windows, bf16=bf16)
    return row


def measure(model, c: Cell, tokenizer, probe: torch.Tensor, step: int, csv_path: Path) -> None:
    """Both snapshots of the probe windows (``own`` and ``t0.15``, fixed draws) appended to ``csv_path``."""
    gen, ratio_gen = torch.Generator().manual_seed(14), torch.Generator().manual_seed(15)
    batches = {"own": cells_mod.corrupt(c, probe, tokenizer, gen, ratio_gen),
               "t0.15": cells_mod.unweighted(cells_mod.corrupt_at(probe, tokenizer, PROBE_T,
                                                                  torch.Generator().manual_seed(16)))}
    attention_mask = (probe != tokenizer.pad_token_id).long()
    for name, batch in batches.items():
        snap = training_snapshot(model, batch.inputs, batch.labels, attention_mask, tokenizer=tokenizer,
                                 loss_fn=snapshot_loss(batch.ratio), step=step)
        write_rows(csv_path, [{**row, "probe": name} for row in snap.rows()])


def write_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` (dicts with the same keys) to the CSV ``path``, the header first if it is new; floats to 7
    significant digits."""
    import csv

    new = not path.exists()
    with path.open("a", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows([{k: (f"{v:.7g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


def run_cell(c: Cell, seed: int, steps: int, data, out: Path, bf16: bool = False, save: bool = False,
             budgets: Sequence[int] = (), state_every: int | None = None, deadline: float | None = None) -> dict | None:
    """Train cell ``c`` from ``seed`` for ``steps`` steps, measuring it at :data:`CHECKPOINTS`; the run's record.
    ``bf16``: the training steps and evaluations under bfloat16 autocast (mini-en's speed trick; slower than float32
    on CPUs without AMX); the snapshots are float32 either way. ``save``: the trained model (float32 safetensors) and its
    tokenizer go to ``out/<cell>-s<seed>.model/``.

    ``budgets``: earlier steps measured like the last (1,024 windows and the final measures; rule 5's 1.5x, 2x and 3x
    budgets of a constant-rate recipe are checkpoints of one run), each saved to ``out/<cell>-s<seed>-<step>.model/``
    when ``save``. The run's state goes to ``out/<cell>-s<seed>.state.pt`` (:mod:`run_state`) after every checkpoint and
    every ``state_every`` steps, and a run with a state resumes from it; past ``deadline`` (a ``time.time()``) the run
    saves its state and returns None. The checkpoints so far are in ``out/<cell>-s<seed>.partial.json`` until the run
    ends."""
    tokenizer, train, valid = data
    probe = valid[FINAL_WINDOWS : FINAL_WINDOWS + PROBE_WINDOWS]
    csv_path = out / f"{c.name}-s{seed}.csv"
    model = build(c, seed, tokenizer)
    opt, schedule = optimizer(model, c)
    gen, ratio_gen = torch.Generator().manual_seed(2 * seed), torch.Generator().manual_seed(2 * seed + 1)
    spath, ppath = run_state.state_path(out, c.name, seed), run_state.partial_path(out, c.name, seed)
    state = run_state.load(spath, model, opt, schedule, gen, ratio_gen)
    if state is None:
        csv_path.unlink(missing_ok=True)  # a run cut before its first state starts again
        state = run_state.RunState(0, [], [], 0.0, 0.0, 0.0)
    else:
        run_state.truncate_csv(csv_path, state.step if state.measured else state.step - 1)
        print(f"{c.name} seed {seed}: resuming at step {state.step}", flush=True)
    start, cpu0 = time.time() - state.wall_s, time.process_time() - state.cpu_s
    finals = set(budgets) | {steps}

    def keep(step: int) -> None:
        state.step, state.wall_s, state.cpu_s = step, time.time() - start, time.process_time() - cpu0
        run_state.save(spath, state, model, opt, schedule, gen, ratio_gen)

    def record() -> dict:
        return {"cell": c.name, "seed": seed, "steps": steps, "recipe": {k: v for k, v in vars(c).items()},
                "changes": list(c.changes()), "candidate": c.candidate, "checkpoints": state.checkpoints,
                "final": state.checkpoints[-1], "budgets": [r for r in state.checkpoints if r["step"] in finals],
                "train_s": round(state.train_s, 1), "wall_s": round(time.time() - start, 1),
                "cpu_s": round(time.process_time() - cpu0, 1), "precision": "bf16 autocast" if bf16 else "float32",
                "torch": torch.__version__,
                "command": "python -m analyses.diffusion_diagnosis.train " + " ".join(sys.argv[1:])}

    for step in range(state.step, steps + 1):
        if (step in CHECKPOINTS or step in finals) and not (step == state.step and state.measured):
            measure(model, c, tokenizer, probe, step, csv_path)
            losses = state.losses
            row = {"step": step, "train_loss": sum(losses[-25:]) / len(losses[-25:]) if losses else None,
                   "lr": schedule.get_last_lr()[0], **evaluate(model, c, tokenizer, valid, step in finals, bf16),
                   "wall_s": round(time.time() - start, 1), "cpu_s": round(time.process_time() - cpu0, 1)}
            state.checkpoints.append(row)
            print(json.dumps({"cell": c.name, "seed": seed, **row}), flush=True)
            if save and step in finals:
                where = out / (f"{c.name}-s{seed}.model" if step == steps else f"{c.name}-s{seed}-{step}.model")
                model.save_pretrained(where, safe_serialization=True)
                tokenizer.save_pretrained(where)
            if step < steps:
                keep(step)
                run_state.write_partial(ppath, record())
        if step == steps:
            break
        tick = time.perf_counter()
        ids = train[torch.randint(len(train), (16,), generator=gen)]
        batch = cells_mod.corrupt(c, ids, tokenizer, gen, ratio_gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = cell_loss(model, batch, (ids != tokenizer.pad_token_id).long())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        state.train_s += time.perf_counter() - tick
        state.losses = state.losses[-24:] + [float(loss.detach())]
        if not math.isfinite(state.losses[-1]):
            raise SystemExit(f"{c.name} seed {seed}: non-finite loss at step {step + 1}")
        if (state_every and (step + 1) % state_every == 0) or (deadline is not None and time.time() > deadline):
            keep(step + 1)
            if deadline is not None and time.time() > deadline:
                print(f"{c.name} seed {seed}: stopped at step {step + 1}, state kept in {spath}", flush=True)
                return None
    result = record()
    spath.unlink(missing_ok=True)
    return result


def planned_runs(names: Sequence[str], seeds: Sequence[int]) -> list[tuple[Cell, int]]:
    """(cell, seed) in sweep order: every cell's first seed before any cell's second."""
    return [(cells_mod.cell(n), s) for s in seeds for n in names]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("figures/diffusion-diagnosis/runs"))
    p.add_argument("--cells", nargs="+", default=[c.name for c in cells_mod.CELLS])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--worker", default="0/1", help="i/n: run every n-th planned run starting at the i-th")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this many minutes (a run in progress keeps its state and resumes next time)")
    p.add_argument("--budgets", type=int, nargs="*", default=[],
                   help="earlier steps measured and saved like the last (rule 5's budgets of a constant-rate recipe)")
    p.add_argument("--state-every", type=int, default=100, help="save the run's state every this many steps")
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("src/gradflow/models/gradflow-mini-en"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save", action="store_true", help="keep each trained model in OUT/<cell>-s<seed>.model/")
    p.add_argument("--bf16", action="store_true", help="train and evaluate under bfloat16 autocast (default float32)")
    args = p.parse_args(argv)
    index, count = (int(x) for x in args.worker.split("/"))
    if not 0 <= index < count:
        p.error(f"--worker {args.worker}: i/n with 0 <= i < n")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if any(not 0 < b < args.steps for b in args.budgets):
        p.error(f"--budgets {args.budgets}: each must lie between 0 and --steps {args.steps}")
    decaying = [n for n in args.cells if not cells_mod.cell(n).constant]
    if args.steps > SCHEDULE_STEPS and decaying:
        p.error(f"--steps {args.steps} runs past the {SCHEDULE_STEPS}-step schedule, whose learning rate has reached 0 "
                f"for {', '.join(decaying)}: longer budgets of a decaying schedule are separate, stretched runs")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    data = load_data(args.corpus, args.tokenizer)
    start = time.time()
    for k, (c, seed) in enumerate(planned_runs(args.cells, args.seeds)):
        path = args.out / f"{c.name}-s{seed}.json"
        if k % count != index or path.exists():
            continue
        if args.max_minutes is not None and time.time() - start > 60 * args.max_minutes:
            print(f"--max-minutes {args.max_minutes:g} reached: stopping before {c.name} seed {seed}", flush=True)
            break
        deadline = None if args.max_minutes is None else start + 60 * args.max_minutes
        record = run_cell(c, seed, args.steps, data, args.out, args.bf16, args.save, args.budgets, args.state_every,
                          deadline)
        if record is None:
            break
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)
        run_state.partial_path(args.out, c.name, seed).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
