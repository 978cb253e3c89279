"""The recorder: hooks in, per-position norms and per-role sublayer statistics out, for one batch.

At every site of :mod:`gradflow.hooks.sites` (``embeddings.out``, ``blocks.{i}.mid``,
``blocks.{i}.out``) the recorder keeps, per position, the L2 norm of the loss gradient w.r.t. the
hidden state and the L2 norm of the hidden state (float32, shape (B, T)).

For every standard sublayer (see :mod:`gradflow.adapters`) it splits the weight gradient by
position role: per (block, sublayer, parameter, role) the norm of the role's contribution, the
summed per-position magnitudes and the position counts (:mod:`gradflow.hooks.sublayer_stats`).

Hooks are forward hooks plus tensor hooks (never ``register_full_backward_hook``); they are
installed on ``__enter__`` and removed on ``__exit__``, also on exceptions. Gradient work happens
inside the tensor hooks, so no activation outlives the autograd graph that saved it. Under
``loss.backward()`` a tensor hook on each Linear sublayer's weight receives the weight gradient
autograd computes anyway, and the largest role's contribution is that minus the other roles'
(:mod:`gradflow.hooks.sublayer_stats`); ``rec.record()`` computes no weight gradient and takes
every role's own product.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from gradflow.adapters import Adapter, get_module
from gradflow.errors import RecorderError
from gradflow.hooks.batch_state import BatchState, RolePartition
from gradflow.hooks.experts import expert_hooks, finish_experts
from gradflow.hooks.passes import check_pass_loss, join_states, pass_inputs, pass_states, pass_widths, placed_logits
from gradflow.hooks.split_experts import plain_fused, split_experts_forwards
from gradflow.hooks.records import BatchRecord, RecorderConfig, SublayerRecord
from gradflow.hooks.router_aux import aux_coefficient, aux_norms, forward_with_aux, measured_weights, router_aux_spec
from gradflow.hooks.safe_norms import safe_norm
from gradflow.hooks.sites import (
    EMBEDDINGS_SITE,
    ForwardHook,
    SiteLayer,
    layer_of,
    model_device,
    point_of,
)
from gradflow.hooks.split_linear import SPLIT_DTYPES, DirectSplit, split_linear_forwards
from gradflow.hooks.sublayer_stats import SublayerEntry, split_by_role, sublayer_stats
from gradflow.inputs.masking import MaskedBatch
from gradflow.losses import LossFn, get_loss, head_loss
from gradflow.roles import Role
from gradflow.schema import PARAMS, sublayer_key


class GradFlowRecorder:
    """Context manager that records gradient flow per position and role.

    ``with GradFlowRecorder(model) as rec: record = rec.record(batch)`` runs forward, the loss and
    ``torch.autograd.grad`` (parameters' ``.grad`` are left untouched). To drive your own
    forward/backward instead: ``with rec.capture(batch.roles): loss.backward()``, then
    ``rec.result()``.

    ``adapter``: None for the adapter registered for the model's ``config.model_type``, an
    :class:`Adapter`, or ``"auto"`` (also ``RecorderConfig(adapter="auto")``) for the generic adapter
    discovered from the module tree (opt-in; it prints what it found; see
    :mod:`gradflow.adapters.generic`).
    """

    def __init__(self, model: nn.Module, config: RecorderConfig | None = None, adapter: Adapter | str | None = None):
        self.model = model
        self.config = config or RecorderConfig()
        if adapter is None and self.config.adapter != "registered":
            adapter = self.config.adapter
        self.sites = SiteLayer(model, adapter, mid=True)
        self.adapter = self.sites.adapter
        self.base = self.sites.base
        self.blocks = self.sites.blocks
        self.num_blocks = self.sites.num_blocks
        self.site_names = self.sites.names
        self.site_layers = tuple(layer_of(name) for name in self.site_names)
        self.site_points = tuple(point_of(name) for name in self.site_names)
        self._site_index = {name: i for i, name in enumerate(self.site_names)}
        self._hooks: ExitStack | None = None
        self._batch: BatchState | None = None
        self._passes: list[BatchState] | None = None  # a two-pass model's states, one per pass (gradflow.hooks.passes)
        self._weight_nodes: dict[int, object] = {}  # id(Linear) -> its weight's AccumulateGrad node
        self.router_aux = None if self.config.router_aux_loss is None else router_aux_spec(self.adapter, model)
        self.aux_coef = (None if self.router_aux is None
                         else aux_coefficient(self.router_aux, model, self.config.router_aux_loss))

    # ------------------------------------------------------------------ hooks in and out
    def __enter__(self) -> "GradFlowRecorder":
        if self._hooks is not None:
            raise RecorderError("this recorder is already active; nested use of one recorder is not supported")
        checkpointing = getattr(type(self.model), "is_activation_checkpointing", None)
        name = "is_activation_checkpointing" if checkpointing is not None else "is_gradient_checkpointing"
        if getattr(self.model, name, False):
            raise RecorderError("gradient checkpointing re-runs forward passes and would record twice: "
                                "call model.gradient_checkpointing_disable() before recording")
        hooks = ExitStack()
        try:
            sublayer_hooks = self._sublayer_hooks()
            hooks.enter_context(self.sites.hooks(self._on_site, extra=sublayer_hooks, on_pass=self._on_pass))
            hooks.callback(self._weight_nodes.clear)
            if self.config.sublayers and self.adapter.experts:
                own = self._own_experts()  # fused experts gradflow runs itself: the split at no extra product
                hooks.enter_context(split_experts_forwards(own, self._current))
                hooks.enter_context(expert_hooks(self.sites.hooked, self.adapter.experts, self._current,
                                                 frozenset(id(module) for module, _, _ in own)))
            self._split_weights([module for module, _ in sublayer_hooks], hooks)
        except BaseException:
            hooks.close()
            raise
        self._hooks = hooks
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks, self._batch, self._passes = self._hooks, None, None, None
        if hooks is not None:
            hooks.close()

    def _split_weights(self, modules: list[nn.Module], hooks: ExitStack) -> None:
        """Route every Linear sublayer module whose weight gradient comes from that module alone (a leaf
        float32, bfloat16 or float16 weight, not shared; ``nn.Linear``'s own forward) through
        :class:`~gradflow.hooks.split_linear.RoleSplitLinear`: under ``loss.backward()`` the largest role's
        contribution is then one of the two products the weight gradient is computed from. An FSDP2 weight (a
        DTensor) is left alone: each forward swaps in a gathered copy, so its gradient node here never runs."""
        from torch.distributed.tensor import DTensor

        uses = Counter(id(p) for _, p in self.model.named_parameters(remove_duplicate=False))
        linears = []
        for module in modules:
            weight = getattr(module, "weight", None)
            if (not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward
                    or not isinstance(weight, nn.Parameter) or not weight.requires_grad
                    or weight.dtype not in SPLIT_DTYPES or uses[id(weight)] != 1 or isinstance(weight, DTensor)):
                continue
            self._weight_nodes[id(module)] = get_gradient_edge(weight).node
            linears.append(module)
        hooks.enter_context(split_linear_forwards(linears, self._take_split, self._weight_runs))

    def _own_experts(self) -> list:
        """(module, experts name, spec) of every fused experts module of the plain layout, each once."""
        found: dict[int, tuple] = {}
        for block in self.sites.hooked:
            for name, spec in self.adapter.experts.items():
                try:
                    module = get_module(block, spec.path)
                except LookupError:
                    continue
                if spec.layout == "fused" and spec.own_forward and spec.unsplittable is None and plain_fused(module):
                    found.setdefault(id(module), (module, name, spec))
        return list(found.values())

    def _current(self) -> tuple[BatchState | None, int | None]:
        return self._batch, self.sites.depths.current

    def _take_split(self, weight: nn.Parameter) -> DirectSplit | None:
        state = self._batch
        return state.deferred.pop(id(weight), None) if state is not None else None

    def _weight_runs(self, module: nn.Linear) -> bool:
        node = self._weight_nodes.get(id(module))
        return node is not None and _engine_runs(node)

    def _sublayer_hooks(self) -> list[tuple[nn.Module, ForwardHook]]:
        """One forward hook per distinct Linear/LayerNorm/RMSNorm-like sublayer module (none without sublayers)."""
        if not self.config.sublayers:
            return []
        hooks: list[tuple[nn.Module, ForwardHook]] = []
        config = getattr(self.model, "config", None)
        for block in self.sites.hooked:
            by_module: dict[int, tuple[nn.Module, list[SublayerEntry]]] = {}
            for name, spec in self.adapter.sublayers.items():
                try:
                    module = get_module(block, spec.path)
                except LookupError:
                    if spec.optional:  # a module some blocks lack (DiffusionGemma's full-attention layers: no v_proj)
                        continue
                    raise
                if not split_by_role(module, spec):
                    continue  # e.g. ModernBERT's first block has nn.Identity as its attention norm
                entry = SublayerEntry(name, spec.chunk, spec.groups(config), spec.bias is not None, spec.acts_as,
                                      call=spec.call, flat=spec.flat)
                by_module.setdefault(id(module), (module, []))[1].append(entry)
            first = self.adapter.sequence_first
            hooks += [(module, self._make_sublayer_hook(entries, any(e.name in first for e in entries)))
                      for module, entries in by_module.values()]
        return hooks

    # ------------------------------------------------------------------ batch state
    @contextmanager
    def capture(self, roles: torch.Tensor, sequence_index: torch.Tensor | None = None,
                widths: tuple[int, ...] | None = None) -> Iterator["GradFlowRecorder"]:
        """Record the one forward and backward run inside this block. ``roles``: (B, T) codes; ``widths``: a
        two-pass model's (P, C), the prompt's positions first (:func:`gradflow.hooks.passes.pass_widths`)."""
        if self._hooks is None:
            raise RecorderError("use the recorder as a context manager: `with GradFlowRecorder(model) as rec:`")
        states = pass_states(self.config, roles, sequence_index, len(self.site_names), widths, self.adapter)
        self._batch, self._passes = states[0], (None if widths is None else states)
        try:
            yield self
        except BaseException:
            self._batch = self._passes = None
            raise
        finally:
            for state in self._passes or ([self._batch] if self._batch is not None else []):
                for split in list(state.deferred.values()):  # no weight gradient came: direct products
                    split.finish(None)
                state.release_graph()

    def _on_pass(self, index: int) -> None:
        """A pass of a two-pass model starts: its hooks fill its own state."""
        if self._passes is not None:
            self._batch = self._passes[index]

    def result(self) -> BatchRecord:
        """Assemble the record of the last capture (CPU tensors) and drop the batch state."""
        state = self._batch
        if state is None:
            raise RecorderError("nothing captured: run a forward and backward inside `rec.capture(roles)` first")
        if self._passes is not None:  # a two-pass model: each pass's experts, then the passes joined along T
            for part in self._passes:
                finish_experts(part)
            state, self._passes = join_states(self._passes), None
        missing = [self.site_names[i] for i, a in enumerate(state.act) if a is None]
        if missing:
            raise RecorderError(f"sites never ran in the forward pass: {', '.join(missing[:4])}; "
                                "was the forward run inside `rec.capture(...)`?")
        finish_experts(state)
        # each kind of statistic stacked on the device and copied to the host once (every copy waits for the device)
        zeros = torch.zeros_like(state.act[0])
        grad = torch.stack([g if g is not None else zeros for g in state.grad]).cpu()
        act = torch.stack(state.act).cpu()
        keys = [key for key, _ in sorted(state.sublayers.items(), key=_sublayer_order)]
        stats = [state.sublayers[key] for key in keys]
        # each record's arrays are rows of these two host tensors (views: one operation each, not seven copies)
        counts = torch.stack([s[0] for s in stats]).cpu().unbind(0) if stats else ()  # K x (NUM_ROLES,) long
        values = torch.stack([torch.stack(s[1:4]) for s in stats]).cpu().unbind(0) if stats else ()  # K x (3, R)
        sublayers = []
        for (depth, name, param), s, count, value in zip(keys, stats, counts, values):
            sublayers.append(SublayerRecord(depth, name, param, count, *value.unbind(0),
                                            position_magnitude=s[4].cpu() if s[4] is not None else None))
        record = BatchRecord(self.site_names, self.site_layers, self.site_points, grad, act,
                             state.roles.cpu(), state.sequence_index.cpu(), state.loss,
                             self.num_blocks, sublayers, state.matrices,
                             {key: value.cpu() for key, value in state.expert_counts.items()})
        self._batch = None
        return record

    # ------------------------------------------------------------------ convenience driver
    def record(self, batch: MaskedBatch, loss: str | LossFn = "mlm", reduction: str = "batch") -> BatchRecord:
        """Forward ``batch``, compute ``loss`` from the logits and backpropagate; return the record.

        ``loss``: ``"mlm"``, ``"all-positions"`` or a callable ``(logits, batch) -> scalar``;
        ``reduction``: ``"batch"`` or ``"sequence"`` (see :mod:`gradflow.losses`).
        Uses ``torch.autograd.grad`` towards the embeddings output, so parameters' ``.grad`` are
        neither read nor written. The model's train/eval mode is left as it is. For a named loss and a
        position-wise MLM head the head runs at the loss positions only (the same loss and gradients: the
        head's output elsewhere gets exactly zero gradient; see :func:`gradflow.losses.cross_entropy_at_labels`).
        """
        loss_fn = get_loss(loss, reduction)
        check_pass_loss(self.adapter, loss)
        batch = batch.to(model_device(self.model))
        head = self._position_wise_head() if isinstance(loss, str) else None
        norms = {}
        if self.router_aux is not None:  # the aux term's share, on a forward of its own (hooks idle: no capture)
            with torch.enable_grad():
                value, aux = self._forward_loss(batch, loss, loss_fn, reduction, head)
                norms = aux_norms(value, aux, measured_weights(self.adapter, self.blocks, self.router_aux))
                del value, aux
        with self.capture(batch.roles, batch.sequence_index, pass_widths(self.adapter, batch)), torch.enable_grad():
            states = self._passes or [self._batch]
            value, aux = self._forward_loss(batch, loss, loss_fn, reduction, head)
            # gradients towards the embeddings output (of every pass) reach every token site; non-token sublayer
            # calls (relative-position projections) hang off parameters only, so they are targets too
            targets = [t for state in states for t in (state.emb_out, *state.extra_targets) if t is not None]
            for state in states:
                state.loss = float(value.detach())
            aux_loss = None if aux is None else float(aux.detach())
            torch.autograd.grad(value if aux is None else value + aux, targets, allow_unused=True)
            del value, aux, targets, states
        record = self.result()
        record.aux_loss, record.router_aux = aux_loss, norms
        return record

    def _forward_loss(self, batch: MaskedBatch, loss: str | LossFn, loss_fn: LossFn, reduction: str,
                      head: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's loss and, with ``router_aux_loss``, the auxiliary router loss term (else None)."""
        inputs = pass_inputs(self.adapter, batch)

        def call(extra: dict) -> tuple[torch.Tensor, object]:
            if head is not None:  # the logits (B, T, V) are not kept past the loss: autograd keeps what it needs
                output = self.base(**inputs, **extra)
                return head_loss(head, output.last_hidden_state, batch, loss, reduction), output
            output = self.model(**inputs, **extra)
            return loss_fn(placed_logits(self.adapter, batch, output.logits), batch), output

        return forward_with_aux(call, self.router_aux, self.model, inputs, self.aux_coef or 0.0)

    def _position_wise_head(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The MLM head as ``hidden (..., H) -> logits (..., V)`` where it reads each position alone from the base
        model's ``last_hidden_state``; None (the whole model runs) otherwise."""
        if (self.adapter.head_mixes_positions or self.adapter.run_whole_model
                or getattr(self.model, "base_model", None) is not self.base):
            return None
        if self.base is self.model:
            return None
        try:
            return self.adapter.head.function(self.model)
        except LookupError:
            return None

    # ------------------------------------------------------------------ site hooks
    def _on_site(self, site: str, hidden: torch.Tensor) -> None:
        """Site-layer callback: watch ``hidden`` (B, T, H) of ``site`` while a capture runs."""
        state = self._batch
        if state is None:
            return None
        if site == EMBEDDINGS_SITE:
            self._match_positions(state, hidden)
            if not hidden.requires_grad:
                hidden.requires_grad_(True)  # frozen embeddings: still let the gradient reach this site
            state.emb_out = hidden
        self._watch_site(state, self._site_index[site], hidden)
        return None

    def _watch_site(self, state: BatchState, index: int, hidden: torch.Tensor) -> None:
        if state.act[index] is not None:
            raise RecorderError(f"site {self.site_names[index]} ran twice: record one forward per capture")
        state.act[index] = safe_norm(hidden.detach(), dim=-1)[:, :state.t]  # (positions the model appended: cut)
        if hidden.requires_grad:
            def on_grad(grad: torch.Tensor) -> None:
                state.grad[index] = safe_norm(grad, dim=-1)[:, :state.t]

            hidden.register_hook(on_grad)

    def _match_positions(self, state: BatchState, hidden: torch.Tensor) -> None:
        """Check the embeddings' (B, T) against the roles'; positions the model appends at the end of the
        sequence (``adapter.appends_padding``: Longformer) join the sublayer split with role ``pad``."""
        b, t = hidden.shape[:2]
        appended = t - state.t
        if b != state.b or appended < 0 or (appended and not self.adapter.appends_padding):
            raise RecorderError(f"roles have shape {(state.b, state.t)} but the batch has (B, T) = "
                                f"{tuple(hidden.shape[:2])}: pass the roles of this very batch to capture()")
        if appended:
            pad = torch.full((b, appended), int(Role.PAD), dtype=state.roles.dtype, device=state.roles.device)
            state.partition = RolePartition.of_roles(torch.cat([state.roles, pad], dim=1))

    # ------------------------------------------------------------------ sublayer hooks
    def _make_sublayer_hook(self, entries: list[SublayerEntry], sequence_first: bool = False) -> ForwardHook:
        """``sequence_first``: the module reads and writes (T, B, ...) tensors (Longformer's q/k/v)."""
        channels_first = self.adapter.channels_first

        def hook(mod: nn.Module, inputs: tuple, output: object) -> object:
            state, depth = self._batch, self.sites.depths.current
            raw = output
            if isinstance(output, tuple) and output:  # (output, scaling factor): I-BERT's modules
                output = output[0]
            if state is None or depth is None or not isinstance(output, torch.Tensor):
                return None
            call = state.calls.get((depth, id(mod)), 0)
            state.calls[(depth, id(mod))] = call + 1
            state.module_calls[id(mod)] = state.module_calls.get(id(mod), 0) + 1
            x = inputs[0].detach()
            if channels_first:  # (B, C, T) -> (B, T, C): one row per position
                x = x.transpose(1, 2)
            if sequence_first:  # (T, B, D) -> (B, T, D)
                x = x.transpose(0, 1)
            named = [e for e in entries if e.call == call]  # names of this very call (X-MOD: one per LayerNorm call)
            served = named or [e for e in entries if e.call is None]
            positions = _model_positions(state)
            if x.dim() == 2 and any(e.flat for e in entries) and x.shape[0] == state.b * positions:
                x = x.reshape(state.b, positions, -1)  # an MoE router's (B * T, H) rows
            token = (call == 0 or bool(named)) and tuple(x.shape[:2]) == (state.b, positions)
            if not served or not output.requires_grad:
                return None

            def on_grad(grad: torch.Tensor) -> None:
                grad = grad.transpose(0, 1) if sequence_first else grad
                node = self._weight_nodes.get(id(mod))
                direct = (token and not sequence_first and node is not None and state.module_calls[id(mod)] == 1
                          and _engine_runs(node))  # rows in the order RoleSplitLinear sees them
                if grad.dim() == 2 and x.dim() == 3:  # a flat module's (B * T, D) rows
                    grad = grad.reshape(*x.shape[:2], -1)
                sublayer_stats(state, depth, mod, served, x, grad.transpose(1, 2) if channels_first else grad, token,
                               direct=direct)

            output.register_hook(on_grad)
            if not token:  # the model gets a copy, so that changing it in place (DeBERTa's pos_q_proj output:
                # pos_query_layer /= scale) cannot drop the hook; non-token (relative-position) outputs are small
                state.extra_targets.append(output)
                copy = output.clone()
                return (copy, *raw[1:]) if isinstance(raw, tuple) else copy
            return None

        return hook


def _engine_runs(node: object) -> bool:
    """Whether the running backward executes ``node`` (a weight's AccumulateGrad): ``loss.backward()`` does,
    ``torch.autograd.grad`` towards activations does not. False where torch cannot tell."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):
        return False


def _model_positions(state: BatchState) -> int:
    """T of the model's hidden states: the batch's T plus any positions the model appended (role pad)."""
    return int(state.partition.codes.numel()) // state.b


def _sublayer_order(item) -> tuple:
    (depth, name, param), _ = item
    return sublayer_key(depth, name, param)


__all__ = ["PARAMS", "BatchRecord", "GradFlowRecorder", "RecorderConfig", "RecorderError", "SublayerRecord"]
