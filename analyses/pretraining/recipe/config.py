"""The run's configuration: one dataclass, architecture presets, and the resume identity check."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ArchSizes:
    """Transformer sizes: blocks, hidden width, heads, FFN width, positions (tokens per window)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    max_len: int


# base: the embedded pair's architecture (RoFormer, post-LN, rotary) twice as deep and wide;
# mini: the shipped gradflow-mini-en sizes; mini12: mini-en's width at base's depth (the 12-block pair
# of issue 31, figures/twelve-blocks/plan.md); tiny: for tests and smoke runs only.
ARCHS: dict[str, ArchSizes] = {
    "base": ArchSizes(layers=12, hidden=512, heads=8, ffn=2048, max_len=128),
    "mini": ArchSizes(layers=6, hidden=256, heads=4, ffn=1024, max_len=128),
    "mini12": ArchSizes(layers=12, hidden=256, heads=4, ffn=1024, max_len=128),
    "tiny": ArchSizes(layers=2, hidden=32, heads=2, ffn=64, max_len=32),
}

# Fields that may change between the commands of one run: they do not change the weights or the
# training curve's values (only where output goes, how often it is written, and when to stop).
# The tokenizer is compared by the hash of its tokenizer.json instead of its path.
RUNTIME_FIELDS: frozenset[str] = frozenset(
    {"out", "tokenizer", "checkpoint_every", "eval_every", "log_every", "max_minutes", "threads", "stop_after",
     "throttle_s", "snapshots"}
)


@dataclass
class RunConfig:
    """Everything that defines one pretraining run. Units: steps are optimiser steps, lr per step."""

    corpus: str
    out: str
    tokenizer: str = ""  # tokenizer folder (trained there once); "" = <out>/tokenizer. Checked by hash on resume
    loss: str = "mlm"  # "mlm": BERT 15% selection, loss there; "alltoken": loss at every non-special token
    arch: str = "base"
    layers: int = 12
    hidden: int = 512
    heads: int = 8
    ffn: int = 2048
    max_len: int = 128
    vocab_size: int = 8192  # requested WordPiece size; the model uses the trained tokenizer's size
    steps: int = 40_000
    batch_size: int = 64  # windows of max_len tokens per step
    lr: float = 5e-4  # peak, after linear warm-up, then linear decay to 0 at ``steps``
    warmup: int = 2_000
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"  # "bfloat16": autocast of the forward pass; master weights stay float32
    sparse: bool = False  # the last block's query side at the loss positions only (same gradients, less compute)
    valid_windows: int = 1024
    # runtime fields (RUNTIME_FIELDS): may differ between the commands of one run
    eval_every: int = 1_000
    checkpoint_every: int = 500
    log_every: int = 50
    max_minutes: float | None = None
    threads: int | None = None
    stop_after: int | None = None  # test hook: stop (with a checkpoint) after this many steps
    throttle_s: float = 0.0  # test hook: sleep this long after each step
    snapshots: int = 0  # weight snapshots at this many log-spaced steps (recipe/snapshots.py); 0 = none

    def __post_init__(self) -> None:
        if self.loss not in ("mlm", "alltoken"):
            raise ValueError(f"loss must be mlm or alltoken, not {self.loss!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, not {self.dtype!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.sparse and self.loss == "alltoken":
            raise ValueError("--sparse skips positions outside the loss; with --loss alltoken there are none")
        if not 0 < self.warmup < self.steps:
            raise ValueError(f"warmup must be in (0, steps): {self.warmup} vs {self.steps}")

    @classmethod
    def from_arch(cls, arch: str, **kwargs: object) -> RunConfig:
        """A config with the preset sizes of ``arch``; explicit size keywords override them."""
        given = {k: v for k, v in kwargs.items() if v is not None}  # None: "use the default / preset"
        sizes = {k: v for k, v in asdict(ARCHS[arch]).items() if k not in given}
        return cls(arch=arch, **sizes, **given)

    def identity(self) -> dict[str, object]:
        """The fields that must match for a resume to continue the same run."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in RUNTIME_FIELDS}


def identity_diff(stored: dict[str, object], new: dict[str, object]) -> list[str]:
    """Human-readable differences ``name: stored -> new`` between two identity dicts. A field the stored
    identity lacks (added to RunConfig after the checkpoint was written) matches its default value."""
    defaults = {f.name: f.default for f in fields(RunConfig)}
    stored = {**{k: defaults[k] for k in new if k not in stored and k in defaults}, **stored}
    keys = sorted(set(stored) | set(new))
    return [f"{k}: {stored.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in keys
            if stored.get(k, "<absent>") != new.get(k, "<absent>")]
