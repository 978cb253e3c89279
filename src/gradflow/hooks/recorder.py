"""The recorder: hooks in, per-position norms and per-role sublayer statistics out, for one batch.

Sites (residual stream, one vector per position):

- ``embeddings.out``: output of the embeddings module (layer 0);
- ``blocks.{i}.mid``: the residual stream after attention and before the FFN of block i;
- ``blocks.{i}.out``: output of block i (layer i + 1).

At every site the recorder keeps, per position, the L2 norm of the loss gradient w.r.t. the hidden
state and the L2 norm of the hidden state (float32, shape (B, T)).

Sublayers (standard names, see :mod:`gradflow.adapters`): for a Linear ``y = x W^T + b`` the weight
gradient is ``sum_t g_t x_t^T`` over positions t. The contribution of a role r is
``G_r = sum_{t in r} g_t x_t^T``; the contributions of all roles (plus ``relpos`` for non-token
inputs) sum exactly to ``W.grad``. Per (block, sublayer, parameter, role) the recorder keeps:

- ``contribution_norm``: ``||G_r||_F``, from the Gram identity
  ``||G_r||^2 = <G G^T, X X^T>`` when that is cheaper, else from ``G_r`` itself;
- ``magnitude_sum``: ``sum_{t in r} ||g_t|| * ||x_t||`` (per-position Frobenius norms, additive);
- ``n_positions`` and ``n_nonzero`` (positions whose per-position magnitude is > 0).

For a LayerNorm ``y = gamma * xhat + beta`` the gain's per-position contribution is
``g_t * xhat_t`` and the bias's is ``g_t``. Roles whose gradient rows are all exactly zero get an
exactly zero contribution (no arithmetic is done on them).

Hooks are forward hooks plus tensor hooks (never ``register_full_backward_hook``); they are
installed on ``__enter__`` and removed on ``__exit__``, also on exceptions. Gradient work happens
inside the tensor hooks, so no activation outlives the autograd graph that saved it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradflow.adapters import Adapter, adapter_for, block_modules, get_module
from gradflow.errors import RecorderError
from gradflow.inputs.masking import MaskedBatch
from gradflow.losses import LossFn, get_loss
from gradflow.roles import ALL_ROLES, NUM_ROLES, TOKEN_ROLES, Role

PARAMS = ("weight", "bias")


@dataclass(frozen=True)
class RecorderConfig:
    """What to record.

    ``sublayers``: the per-role split of every sublayer's weight gradient (else site norms only).
    ``materialize``: also keep every role's summed gradient matrix ``G_r`` (CPU, float32): for
    checks and small models only. ``position_magnitudes``: also keep the (B, T) per-position
    magnitudes of every sublayer parameter.
    """

    sublayers: bool = True
    materialize: bool = False
    position_magnitudes: bool = False


@dataclass
class SublayerRecord:
    """Per-role statistics of one sublayer parameter at one depth. Arrays are (NUM_ROLES,)."""

    depth: int
    sublayer: str
    param: str
    n_positions: torch.Tensor
    n_nonzero: torch.Tensor
    magnitude_sum: torch.Tensor
    contribution_norm: torch.Tensor
    position_magnitude: torch.Tensor | None = None


@dataclass
class BatchRecord:
    """Everything recorded for one batch (all tensors on CPU, float32 unless noted).

    ``grad_norm`` and ``act_norm``: (S, B, T) over ``site_names``; ``roles``: (B, T) int8;
    ``sublayers``: one :class:`SublayerRecord` per (depth, sublayer, parameter);
    ``matrices``: (depth, sublayer, param, role) -> summed gradient of that role, when materialised.
    """

    site_names: tuple[str, ...]
    site_layers: tuple[int, ...]
    site_points: tuple[str, ...]
    grad_norm: torch.Tensor
    act_norm: torch.Tensor
    roles: torch.Tensor
    sequence_index: torch.Tensor
    loss: float
    num_blocks: int
    sublayers: list[SublayerRecord] = field(default_factory=list)
    matrices: dict[tuple[int, str, str, str], torch.Tensor] = field(default_factory=dict)

    def site(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad_norm, act_norm) of one site, each (B, T)."""
        i = self.site_names.index(name)
        return self.grad_norm[i], self.act_norm[i]

    def site_frame(self) -> pd.DataFrame:
        """Tidy per (site, role): n_positions, grad_norm_mean, grad_norm_max, act_norm_mean."""
        rows = []
        roles = self.roles.reshape(-1).long()
        for s, name in enumerate(self.site_names):
            g = self.grad_norm[s].reshape(-1)
            a = self.act_norm[s].reshape(-1)
            for code, role in enumerate(TOKEN_ROLES):
                sel = roles == code
                n = int(sel.sum())
                if n == 0:
                    continue
                rows.append({"site": name, "layer": self.site_layers[s], "point": self.site_points[s],
                             "role": role, "n_positions": n, "grad_norm_mean": float(g[sel].mean()),
                             "grad_norm_max": float(g[sel].max()), "act_norm_mean": float(a[sel].mean())})
        return pd.DataFrame(rows)

    def sublayer_frame(self) -> pd.DataFrame:
        """Tidy per (layer, sublayer, param, role); ``layer`` = depth + 1; ``share`` sums to 1."""
        rows = []
        for rec in self.sublayers:
            total = float(rec.magnitude_sum.sum())
            for code, role in enumerate(ALL_ROLES):
                n = int(rec.n_positions[code])
                if n == 0:
                    continue
                mag = float(rec.magnitude_sum[code])
                rows.append({"layer": rec.depth + 1, "sublayer": rec.sublayer, "param": rec.param,
                             "role": role, "n_positions": n, "n_nonzero": int(rec.n_nonzero[code]),
                             "magnitude_sum": mag, "share": mag / total if total > 0 else 0.0,
                             "contribution_norm": float(rec.contribution_norm[code])})
        return pd.DataFrame(rows)



class _SublayerEntry:
    """One standard name served by a module (a fused module serves several)."""

    __slots__ = ("name", "chunk")

    def __init__(self, name: str, chunk: tuple[int, int] | None):
        self.name = name
        self.chunk = chunk


class GradFlowRecorder:
    """Context manager that records gradient flow per position and role.

    ``with GradFlowRecorder(model) as rec: record = rec.record(batch)`` runs forward, the loss and
    ``torch.autograd.grad`` (parameters' ``.grad`` are left untouched). To drive your own
    forward/backward instead: ``with rec.capture(batch.roles): loss.backward()``, then
    ``rec.result()``.
    """

    def __init__(self, model: nn.Module, config: RecorderConfig | None = None, adapter: Adapter | None = None):
        self.model = model
        self.config = config or RecorderConfig()
        self.adapter = adapter or adapter_for(model)
        self.base = model.base_model
        self.blocks = block_modules(self.adapter, self.base)
        self.num_blocks = len(self.blocks)
        self.site_names = ("embeddings.out", *[f"blocks.{i}.{p}" for i in range(self.num_blocks) for p in ("mid", "out")])
        self.site_layers = (0, *[i + 1 for i in range(self.num_blocks) for _ in range(2)])
        self.site_points = ("out", *[p for _ in range(self.num_blocks) for p in ("mid", "out")])
        self._handles: list[RemovableHandle] = []
        self._active = False
        self._batch: dict | None = None

    # ------------------------------------------------------------------ hooks in and out
    def __enter__(self) -> "GradFlowRecorder":
        if self._handles:
            raise RecorderError("this recorder is already active; nested use of one recorder is not supported")
        checkpointing = getattr(type(self.model), "is_activation_checkpointing", None)
        name = "is_activation_checkpointing" if checkpointing is not None else "is_gradient_checkpointing"
        if getattr(self.model, name, False):
            raise RecorderError("gradient checkpointing re-runs forward passes and would record twice: "
                                "call model.gradient_checkpointing_disable() before recording")
        try:
            self._install()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()
        self._batch = None

    def _install(self) -> None:
        occurrences: dict[int, list[int]] = {}
        for depth, block in enumerate(self.blocks):
            occurrences.setdefault(id(block), []).append(depth)
        emb = get_module(self.base, self.adapter.embeddings)
        self._handles.append(emb.register_forward_hook(self._embeddings_hook))
        seen: set[int] = set()
        for block in self.blocks:
            if id(block) in seen:
                continue
            seen.add(id(block))
            depths = occurrences[id(block)]
            self._handles.append(block.register_forward_pre_hook(self._make_block_pre_hook(depths)))
            self._handles.append(block.register_forward_hook(self._block_out_hook))
            mid_path, mid_kind = self.adapter.mid
            mid_module = get_module(block, mid_path)
            if mid_kind == "output":
                self._handles.append(mid_module.register_forward_hook(self._mid_out_hook))
            else:
                self._handles.append(mid_module.register_forward_pre_hook(self._mid_in_hook))
            if self.config.sublayers:
                self._install_sublayers(block)

    def _install_sublayers(self, block: nn.Module) -> None:
        by_module: dict[int, tuple[nn.Module, list[_SublayerEntry]]] = {}
        for name, spec in self.adapter.sublayers.items():
            module = get_module(block, spec.path)
            if not isinstance(module, (nn.Linear, nn.LayerNorm)):
                continue  # e.g. ModernBERT's first block has nn.Identity as its attention norm
            by_module.setdefault(id(module), (module, []))[1].append(_SublayerEntry(name, spec.chunk))
        for module, entries in by_module.values():
            self._handles.append(module.register_forward_hook(self._make_sublayer_hook(module, entries)))

    def _remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    # ------------------------------------------------------------------ batch state
    @contextmanager
    def capture(self, roles: torch.Tensor, sequence_index: torch.Tensor | None = None) -> Iterator["GradFlowRecorder"]:
        """Record the one forward and backward run inside this block. ``roles``: (B, T) codes."""
        if not self._handles:
            raise RecorderError("use the recorder as a context manager: `with GradFlowRecorder(model) as rec:`")
        roles = roles.to(torch.int8)
        flat = roles.reshape(-1).long()
        b, t = roles.shape
        self._batch = {
            "B": b, "T": t, "roles": roles, "flat": flat,
            "index": [torch.nonzero(flat == code).squeeze(1) for code in range(NUM_ROLES)],
            "counts": torch.bincount(flat, minlength=NUM_ROLES),
            "sequence_index": sequence_index if sequence_index is not None else torch.arange(b),
            "grad": [None] * len(self.site_names), "act": [None] * len(self.site_names),
            "depth_stack": [], "calls": {}, "block_calls": {}, "sublayers": {}, "matrices": {},
            "emb_out": None, "extra_targets": [], "loss": float("nan"),
        }
        try:
            yield self
        except BaseException:
            self._batch = None
            raise
        finally:
            if self._batch is not None:
                self._batch["emb_out"] = None
                self._batch["extra_targets"] = []

    def result(self) -> BatchRecord:
        """Assemble the record of the last capture (CPU tensors) and drop the batch state."""
        state = self._batch
        if state is None:
            raise RecorderError("nothing captured: run a forward and backward inside `rec.capture(roles)` first")
        b, t = state["B"], state["T"]
        zeros = torch.zeros(b, t)
        missing = [self.site_names[i] for i, a in enumerate(state["act"]) if a is None]
        if missing:
            raise RecorderError(f"sites never ran in the forward pass: {', '.join(missing[:4])}; "
                                "was the forward run inside `rec.capture(...)`?")
        grad = torch.stack([g.cpu() if g is not None else zeros for g in state["grad"]])
        act = torch.stack([a.cpu() for a in state["act"]])
        sublayers = []
        for (depth, name, param), stats in sorted(state["sublayers"].items(), key=_sublayer_order):
            sublayers.append(SublayerRecord(depth, name, param, *(s.cpu() for s in stats[:4]),
                                            position_magnitude=stats[4].cpu() if stats[4] is not None else None))
        record = BatchRecord(self.site_names, self.site_layers, self.site_points, grad, act,
                             state["roles"].cpu(), state["sequence_index"].cpu(), state["loss"],
                             self.num_blocks, sublayers, state["matrices"])
        self._batch = None
        return record

    # ------------------------------------------------------------------ convenience driver
    def record(self, batch: MaskedBatch, loss: str | LossFn = "mlm", reduction: str = "batch") -> BatchRecord:
        """Forward ``batch``, compute ``loss`` from the logits and backpropagate; return the record.

        ``loss``: ``"mlm"``, ``"all-positions"`` or a callable ``(logits, batch) -> scalar``;
        ``reduction``: ``"batch"`` or ``"sequence"`` (see :mod:`gradflow.losses`).
        Uses ``torch.autograd.grad`` towards the embeddings output, so parameters' ``.grad`` are
        neither read nor written. The model's train/eval mode is left as it is.
        """
        loss_fn = get_loss(loss, reduction)
        device = _model_device(self.model)
        batch = batch.to(device)
        with self.capture(batch.roles, batch.sequence_index), torch.enable_grad():
            output = self.model(**batch.model_inputs())
            value = loss_fn(output.logits, batch)
            # gradients towards the embeddings output reach every token site; non-token sublayer calls
            # (relative-position projections) hang off parameters only, so they are targets too
            targets = [self._batch["emb_out"], *self._batch["extra_targets"]]
            self._batch["loss"] = float(value.detach())
            torch.autograd.grad(value, targets, allow_unused=True)
            del output, value, targets
        return self.result()

    # ------------------------------------------------------------------ site hooks
    def _state(self) -> dict | None:
        return self._batch

    def _embeddings_hook(self, module, inputs, output):
        state = self._state()
        if state is None:
            return None
        hidden = _first_tensor(output)
        if tuple(hidden.shape[:2]) != (state["B"], state["T"]):
            raise RecorderError(f"roles have shape {(state['B'], state['T'])} but the batch has (B, T) = "
                                f"{tuple(hidden.shape[:2])}: pass the roles of this very batch to capture()")
        if not hidden.requires_grad:
            hidden.requires_grad_(True)  # frozen embeddings: still let the gradient reach this site
        state["emb_out"] = hidden
        self._watch_site(state, 0, hidden)
        return None

    def _make_block_pre_hook(self, depths: list[int]):
        def hook(module, args):
            state = self._state()
            if state is None:
                return None
            count = state["block_calls"].get(id(module), 0)
            if count >= len(depths):
                raise RecorderError("a block ran more often than once per forward: record one forward per capture")
            state["block_calls"][id(module)] = count + 1
            state["depth_stack"].append(depths[count])
            state["calls"] = {}
            return None

        return hook

    def _block_out_hook(self, module, inputs, output):
        state = self._state()
        if state is None:
            return None
        depth = state["depth_stack"].pop()
        self._watch_site(state, 2 + 2 * depth, _first_tensor(output))
        return None

    def _mid_out_hook(self, module, inputs, output):
        state = self._state()
        if state is not None and state["depth_stack"]:
            self._watch_site(state, 1 + 2 * state["depth_stack"][-1], _first_tensor(output))
        return None

    def _mid_in_hook(self, module, args):
        state = self._state()
        if state is not None and state["depth_stack"]:
            self._watch_site(state, 1 + 2 * state["depth_stack"][-1], args[0])
        return None

    def _watch_site(self, state: dict, index: int, hidden: torch.Tensor) -> None:
        if state["act"][index] is not None:
            raise RecorderError(f"site {self.site_names[index]} ran twice: record one forward per capture")
        state["act"][index] = torch.linalg.vector_norm(hidden.detach(), dim=-1, dtype=torch.float32)
        if hidden.requires_grad:
            def on_grad(grad: torch.Tensor) -> None:
                state["grad"][index] = torch.linalg.vector_norm(grad, dim=-1, dtype=torch.float32)

            hidden.register_hook(on_grad)

    # ------------------------------------------------------------------ sublayer hooks
    def _make_sublayer_hook(self, module: nn.Module, entries: list[_SublayerEntry]):
        def hook(mod, inputs, output):
            state = self._state()
            if state is None or not state["depth_stack"] or not isinstance(output, torch.Tensor):
                return None
            depth = state["depth_stack"][-1]
            call = state["calls"].get(id(mod), 0)
            state["calls"][id(mod)] = call + 1
            x = inputs[0].detach()
            token = call == 0 and tuple(x.shape[:2]) == (state["B"], state["T"])
            if not output.requires_grad:
                return None

            def on_grad(grad: torch.Tensor) -> None:
                if isinstance(mod, nn.Linear):
                    self._linear_stats(state, depth, mod, entries, x, grad, token)
                else:
                    self._norm_stats(state, depth, mod, entries, x, grad, token)

            output.register_hook(on_grad)
            if not token:
                state["extra_targets"].append(output)
            return None

        return hook

    def _partition(self, state: dict, rows: int, token: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """(role code per row, row indices per role, count per role) for one sublayer call."""
        if token:
            return state["flat"], state["index"], state["counts"]
        device = state["flat"].device
        codes = torch.full((rows,), int(Role.RELPOS), dtype=torch.long, device=device)
        index = [torch.empty(0, dtype=torch.long, device=device)] * NUM_ROLES
        index[Role.RELPOS] = torch.arange(rows, device=device)
        counts = torch.zeros(NUM_ROLES, dtype=torch.long, device=device)
        counts[Role.RELPOS] = rows
        return codes, index, counts

    def _linear_stats(self, state, depth, mod: nn.Linear, entries, x, grad, token) -> None:
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad.reshape(-1, grad.shape[-1])
        codes, index, counts = self._partition(state, x2.shape[0], token)
        xn = torch.linalg.vector_norm(x2, dim=1, dtype=torch.float32)
        x_gram: dict[int, torch.Tensor] = {}
        for entry in entries:
            g = g2 if entry.chunk is None else _rows(g2, entry.chunk)
            gn = torch.linalg.vector_norm(g, dim=1, dtype=torch.float32)
            mag = gn * xn
            g_sum = _scatter(gn, codes).tolist()
            norms = torch.zeros(NUM_ROLES)
            for code in range(NUM_ROLES):
                if g_sum[code] == 0.0:  # every gradient row of this role is exactly zero: so is G_r
                    if self.config.materialize and int(counts[code]):
                        key = (depth, entry.name, "weight", ALL_ROLES[code])
                        state["matrices"][key] = torch.zeros(g.shape[1], x2.shape[1])
                    continue
                idx = index[code]
                gr, xr = g[idx].float(), x2[idx].float()
                if self.config.materialize:
                    matrix = gr.T @ xr
                    state["matrices"][(depth, entry.name, "weight", ALL_ROLES[code])] = matrix.cpu()
                    norms[code] = float(torch.linalg.matrix_norm(matrix))
                elif idx.numel() * (g.shape[1] + x2.shape[1]) < g.shape[1] * x2.shape[1]:
                    if code not in x_gram:
                        x_gram[code] = xr @ xr.T
                    gram = ((gr @ gr.T) * x_gram[code]).sum(dtype=torch.float64)
                    norms[code] = math.sqrt(max(float(gram), 0.0))
                else:
                    norms[code] = float(torch.linalg.matrix_norm(gr.T @ xr))
            self._store(state, depth, entry.name, "weight", codes, counts, mag, norms)
            if mod.bias is not None:
                sums = torch.zeros(NUM_ROLES, g.shape[1], dtype=torch.float32, device=g.device)
                sums.index_add_(0, codes, g.float())
                self._store(state, depth, entry.name, "bias", codes, counts, gn,
                            torch.linalg.vector_norm(sums, dim=1).cpu())
                if self.config.materialize:
                    for code in range(NUM_ROLES):
                        if int(counts[code]):
                            state["matrices"][(depth, entry.name, "bias", ALL_ROLES[code])] = sums[code].cpu()

    def _norm_stats(self, state, depth, mod: nn.LayerNorm, entries, x, grad, token) -> None:
        d = x.shape[-1]
        x2 = x.reshape(-1, d).float()
        g2 = grad.reshape(-1, d).float()
        codes, index, counts = self._partition(state, x2.shape[0], token)
        xhat = F.layer_norm(x2, mod.normalized_shape, eps=mod.eps)
        for entry in entries:
            for param, per_pos in (("weight", g2 * xhat), ("bias", g2)):
                if getattr(mod, param) is None:
                    continue
                sums = torch.zeros(NUM_ROLES, d, dtype=torch.float32, device=g2.device)
                sums.index_add_(0, codes, per_pos)
                mag = torch.linalg.vector_norm(per_pos, dim=1)
                self._store(state, depth, entry.name, param, codes, counts, mag,
                            torch.linalg.vector_norm(sums, dim=1).cpu())
                if self.config.materialize:
                    for code in range(NUM_ROLES):
                        if int(counts[code]):
                            state["matrices"][(depth, entry.name, param, ALL_ROLES[code])] = sums[code].cpu()

    def _store(self, state, depth, name, param, codes, counts, mag, norms) -> None:
        """Add one call's statistics to (depth, name, param); several calls (relpos) accumulate."""
        key = (depth, name, param)
        n_nonzero = _scatter((mag > 0).float(), codes)
        mag_sum = _scatter(mag, codes)
        position = None
        if self.config.position_magnitudes and int(counts[Role.RELPOS]) == 0:
            position = mag.reshape(state["B"], state["T"])
        if key in state["sublayers"]:
            old = state["sublayers"][key]
            # contributions of separate calls add as matrices; their norms are kept per role, and the
            # calls of one sublayer never share a role (tokens vs relpos), so the norms simply add.
            state["sublayers"][key] = (old[0] + counts.cpu(), old[1] + n_nonzero.cpu(), old[2] + mag_sum.cpu(),
                                       old[3] + norms, old[4] if old[4] is not None else position)
        else:
            state["sublayers"][key] = (counts.cpu().clone(), n_nonzero.cpu(), mag_sum.cpu(), norms, position)


def _scatter(values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(NUM_ROLES, dtype=torch.float32, device=values.device)
    return out.index_add_(0, codes, values.float())


def _rows(g: torch.Tensor, chunk: tuple[int, int]) -> torch.Tensor:
    i, n = chunk
    size = g.shape[1] // n
    return g[:, i * size : (i + 1) * size]


def _first_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise RecorderError(f"cannot find the hidden state in a module output of type {type(output).__name__}")


def _model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _sublayer_order(item) -> tuple:
    from gradflow.adapters import SUBLAYER_NAMES

    (depth, name, param), _ = item
    return (depth, SUBLAYER_NAMES.index(name), PARAMS.index(param))
