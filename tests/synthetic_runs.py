"""Synthetic run directories with the exact columns of the run contract and known answers.

Per-position gradient norms are drawn as ``scale[layer, role] * sequence_effect * lognormal``;
the noise has the same distribution for every role, so the true ratio of a role's mean to the
pooled loss-position mean is ``scale[role] / scale[loss]``. Loss roles (masked, random, kept) all
have scale 1, so the true context / loss ratio at layer ``l`` is ``context_ratios[l]``. Under the
MLM loss the context channels of the last block (its ``mid`` and ``out`` sites) get exactly zero.

``mask_ratios`` (one t per sequence) makes a masked-diffusion run: a fraction t of each sequence's inner
tokens drawn as masked (none random or kept; none at all for a small t on a short sequence, and then its
gradient is all zeros), ``mask_ratios.parquet`` written, and meta.json's masking that of
``--objective diffusion`` (``t_drawn``: t drawn per sequence, else a grid).

Sublayer shares are set directly: context gets ``context_share`` of every sublayer, except the
after-mixing sublayers of the last block (``attn.q``, ``attn.out``, ``attn.norm``, ``ffn.*``), where
it gets exactly 0 with coverage 0. The rest is split between the other roles by position count.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

TOKEN_ROLES = ("masked", "random", "kept", "context", "special", "pad")
SUBLAYERS = ("attn.q", "attn.k", "attn.v", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm")
AFTER_MIXING = ("attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm")
ROLE_SCALES = {"masked": 1.0, "random": 1.0, "kept": 1.0, "special": 0.3, "pad": 0.0}


def default_context_ratios(num_layers: int) -> np.ndarray:
    """True context / loss ratio per layer 0..L: 0.8 at the embeddings falling to 0.2, 0 at the last."""
    ratios = np.linspace(0.8, 0.2, num_layers + 1)
    ratios[-1] = 0.0
    return ratios


def sample_roles(n_sequences: int, seq_len: int, rng: np.random.Generator,
                 mask_ratios: Sequence[float] | None = None) -> np.ndarray:
    """(S, T) role codes (indices into TOKEN_ROLES): specials at both ends, some pad, 15% selected (with
    ``mask_ratios``: a fraction t of each sequence's inner tokens, all masked, possibly none)."""
    roles = np.full((n_sequences, seq_len), 3, dtype=np.int8)
    for s in range(n_sequences):
        n_pad = int(rng.integers(0, 4))
        end = seq_len - n_pad
        roles[s, end:] = 5
        roles[s, 0] = roles[s, end - 1] = 4
        inner = np.arange(1, end - 1)
        if mask_ratios is not None:
            roles[s, inner[rng.random(inner.size) < mask_ratios[s]]] = 0
            continue
        chosen = inner[rng.random(inner.size) < 0.15]
        if chosen.size == 0:
            chosen = inner[:1]
        u = rng.random(chosen.size)
        roles[s, chosen] = np.where(u < 0.8, 0, np.where(u < 0.9, 1, 2))
        roles[s, chosen[0]] = 0  # every sequence has at least one masked position
    return roles


def _sites(num_layers: int) -> list[tuple[str, int, str]]:
    """(site, layer, point) of every recorded site."""
    sites = [("embeddings.out", 0, "out")]
    for i in range(num_layers):
        sites += [(f"blocks.{i}.mid", i + 1, "mid"), (f"blocks.{i}.out", i + 1, "out")]
    return sites


def _position_frame(num_layers: int, n_sequences: int, seq_len: int, context_ratios: np.ndarray, noise: float,
                    loss: str, rng: np.random.Generator,
                    mask_ratios: Sequence[float] | None = None) -> pd.DataFrame:
    """One row per (sequence, position, site): role, grad_norm, act_norm."""
    roles = sample_roles(n_sequences, seq_len, rng, mask_ratios)
    seq_effect = rng.lognormal(0.0, 0.3, size=(n_sequences, 1)) * (roles == 0).any(axis=1, keepdims=True)
    frames = []
    for site, layer, point in _sites(num_layers):
        scale = np.array([ROLE_SCALES.get(r, 0.0) for r in TOKEN_ROLES])
        scale[3] = context_ratios[layer]
        if loss != "mlm" and layer == num_layers:
            scale[3] = 1.0
        g = scale[roles] * seq_effect * rng.lognormal(0.0, noise, size=roles.shape) * (1.1 if point == "mid" else 1)
        a = 10.0 + rng.normal(0.0, 1.0, size=roles.shape) ** 2
        frames.append(pd.DataFrame({
            "sequence_index": np.repeat(np.arange(n_sequences), seq_len), "site": site, "layer": layer,
            "point": point, "role": np.asarray(TOKEN_ROLES)[roles.reshape(-1)], "grad_norm": g.reshape(-1),
            "act_norm": a.reshape(-1)}))
    return pd.concat(frames, ignore_index=True)


def _channels(pos: pd.DataFrame) -> pd.DataFrame:
    """channels.csv from per-position rows."""
    def summarise(group: pd.DataFrame) -> pd.Series:
        g, a = group["grad_norm"].to_numpy(), group["act_norm"].to_numpy()
        return pd.Series({
            "n_positions": g.size, "grad_norm_mean": g.mean(), "grad_norm_std": g.std(),
            "grad_norm_median": np.median(g), "grad_norm_q05": np.quantile(g, 0.05),
            "grad_norm_q95": np.quantile(g, 0.95), "grad_norm_zero_fraction": float(np.mean(g == 0)),
            "act_norm_mean": a.mean(), "act_norm_std": a.std(), "act_norm_median": np.median(a)})
    out = pos.groupby(["site", "layer", "point", "role"], sort=False).apply(summarise, include_groups=False)
    out = out.reset_index()
    out["n_positions"] = out["n_positions"].astype(int)
    return out


def _sequences(pos: pd.DataFrame) -> pd.DataFrame:
    """sequences.parquet from per-position rows."""
    pos = pos.assign(grad_sq=pos["grad_norm"] ** 2)
    out = pos.groupby(["sequence_index", "site", "layer", "point", "role"], sort=False).agg(
        n_positions=("grad_norm", "size"), grad_norm_sum=("grad_norm", "sum"), grad_norm_sq_sum=("grad_sq", "sum"),
        act_norm_sum=("act_norm", "sum")).reset_index()
    return out


def _sublayers(num_layers: int, role_counts: dict[str, int], context_share: float, loss: str,
               relpos: bool, n_batches: int) -> pd.DataFrame:
    """sublayers.csv with known context shares (see the module docstring)."""
    rows = []
    others = [r for r in TOKEN_ROLES if r not in ("context", "pad")]
    other_total = sum(role_counts[r] for r in others)
    for layer in range(1, num_layers + 1):
        for sub in SUBLAYERS:
            zero = loss == "mlm" and layer == num_layers and sub in AFTER_MIXING
            ctx = 0.0 if zero else context_share
            rel = 0.05 if relpos and sub in ("attn.q", "attn.k") else 0.0
            shares = {r: (1.0 - ctx - rel) * role_counts[r] / other_total for r in others}
            shares.update(context=ctx, pad=0.0)
            if rel:
                shares["relpos"] = rel
            total = 100.0 * layer
            for param in ("weight", "bias"):
                for role, share in shares.items():
                    n = role_counts.get(role, 16)
                    if n == 0:
                        continue  # like the recorder: roles without positions have no row
                    nz = 0 if share == 0 else n
                    rows.append({"layer": layer, "sublayer": sub, "param": param, "role": role, "n_positions": n,
                                 "n_nonzero": nz, "coverage": nz / n, "magnitude_sum": share * total,
                                 "share": share, "contribution_norm_mean": share * total / 10,
                                 "contribution_norm_std": share, "n_batches": n_batches})
    return pd.DataFrame(rows)


def make_meta(num_layers: int, loss: str = "mlm", complete: bool = True, tokenizer_hash: str = "tok-a",
              model: str = "synthetic/bert-tiny", seed: int = 0, counts: dict | None = None) -> dict[str, Any]:
    """A meta.json dict with every key of the contract."""
    return {
        "model": model, "family": "bert", "num_layers": num_layers,
        "tokenizer": {"name_or_path": "synthetic-tokenizer", "vocab_size": 64, "hash": tokenizer_hash},
        "masking": {"scheme": "bert", "mask_prob": 0.15, "mask": 0.8, "random": 0.1, "keep": 0.1},
        "loss": loss, "seed": seed, "complete": complete, "versions": {"gradflow": "0.1.0", "torch": "synthetic"},
        "command": "gradflow run synthetic", "counts": counts or {},
    }


def make_run_tables(num_layers: int = 4, n_sequences: int = 40, seq_len: int = 24, seed: int = 0,
                    context_ratios: Sequence[float] | None = None, context_share: float = 0.6, noise: float = 0.5,
                    loss: str = "mlm", complete: bool = True, tokenizer_hash: str = "tok-a",
                    relpos: bool = False, mask_ratios: Sequence[float] | None = None,
                    t_drawn: bool = True) -> dict[str, Any]:
    """The four run tables as {"channels", "sublayers", "sequences": DataFrame, "meta": dict} (with
    ``mask_ratios``, one per sequence: also "mask_ratios", a masked-diffusion run's)."""
    rng = np.random.default_rng(seed)
    ratios = default_context_ratios(num_layers) if context_ratios is None else np.asarray(context_ratios, float)
    pos = _position_frame(num_layers, n_sequences, seq_len, ratios, noise, loss, rng, mask_ratios)
    first = pos[pos["site"] == "embeddings.out"]
    role_counts = {r: int((first["role"] == r).sum()) for r in TOKEN_ROLES}
    counts = {"sequences": n_sequences, "positions": int(len(first)), "roles": role_counts}
    tables = {"channels": _channels(pos), "sequences": _sequences(pos),
              "sublayers": _sublayers(num_layers, role_counts, context_share, loss, relpos, n_batches=5),
              "meta": make_meta(num_layers, loss, complete, tokenizer_hash, seed=seed, counts=counts)}
    if mask_ratios is not None:
        grid = [] if t_drawn else sorted(set(map(float, mask_ratios)))
        tables["meta"]["masking"] = {"policy": "diffusion", "t": "uniform" if t_drawn else "grid", "eps": 1e-3,
                                     "ratio": None, "ratios": grid, "weights": "1/t", "seed": seed, "shift": False}
        tables["mask_ratios"] = pd.DataFrame({"sequence_index": np.arange(n_sequences),
                                              "mask_ratio": np.asarray(mask_ratios, dtype=np.float64)})
    return tables


def write_tables(path: str | Path, tables: dict[str, Any]) -> Path:
    """Write run tables (as returned by :func:`make_run_tables`) into a run directory."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tables["channels"].to_csv(root / "channels.csv", index=False)
    tables["sublayers"].to_csv(root / "sublayers.csv", index=False)
    tables["sequences"].to_parquet(root / "sequences.parquet", index=False)
    (root / "meta.json").write_text(json.dumps(tables["meta"], indent=2), encoding="utf-8")
    if "mask_ratios" in tables:
        tables["mask_ratios"].to_parquet(root / "mask_ratios.parquet", index=False)
    return root


def write_run(path: str | Path, **kwargs: Any) -> Path:
    """Write a synthetic run directory (kwargs go to :func:`make_run_tables`); returns its path."""
    return write_tables(path, make_run_tables(**kwargs))
