"""The adapter: every architecture fact gradflow relies on, for one family.

An adapter is data: dotted module paths relative to the model's base model
(``model.base_model``), under gradflow's standard names, plus a few small functions for the rare
families that need more than a path (ALBERT's shared layer, ESM's contact head, DeBERTa-v2's head).
The recorder, surgery, fine-tuning and diagnostics read adapters and never branch on
``model_type`` or ``family``.

Standard sublayer names: ``attn.q``, ``attn.k``, ``attn.v``, ``attn.out``, ``attn.norm``,
``ffn.in``, ``ffn.gate`` (gated FFNs), ``ffn.out``, ``ffn.norm``. A fused projection (one Linear
for Q, K and V, or for the FFN input and gate) is split by output rows with ``chunk=(i, n)``: the
i-th of n equal row blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from gradflow.adapters.experts import ExpertsSpec, RouterAuxSpec
from gradflow.adapters.two_pass import TwoPassSpec

SUBLAYER_NAMES: tuple[str, ...] = (
    "attn.q", "attn.k", "attn.v", "attn.out", "attn.norm", "ffn.in", "ffn.gate", "ffn.out", "ffn.norm",
)


@dataclass(frozen=True)
class SublayerSpec:
    """One standard sublayer: a module path inside the block and an optional row chunk."""

    path: str
    chunk: tuple[int, int] | None = None
    interleave: str | None = None
    """With ``chunk`` = (i, n): the config attribute (``"num_attention_heads"``) giving G: the output rows form
    G equal groups, each cut into n equal parts, and the sublayer is the i-th part of every group (DeBERTa v1)."""
    bias: str | None = None
    """Path (in the block) of a Parameter added to this sublayer's output rows outside the module (DeBERTa v1's
    ``attention.self.q_bias``): it is split by role as the sublayer's ``bias``."""
    acts_as: str | None = None
    """``"linear"`` or ``"layer_norm"``: the module is no nn.Linear/nn.LayerNorm but computes one of its first
    input, possibly returning an (output, ...) tuple (I-BERT's QuantLinear, IntLayerNorm with quant_mode off)."""
    call: int | None = None
    """Only the module's ``call``-th call (0-based) in a block, on the block's positions, is this sublayer (X-MOD's
    ``output.LayerNorm`` runs twice per block: one name per call); None: its first call (later calls: ``relpos``)."""
    flat: bool = False
    """The module reads the block's positions as (B * T, D) rows (an MoE router reads the flattened hidden states)."""
    optional: bool = False
    """Some blocks lack the module (DiffusionGemma's full-attention layers have no ``v_proj``): skipped there."""

    def groups(self, config: object) -> int:
        """G of ``interleave`` read from ``config`` (1 without ``interleave``: one contiguous chunk)."""
        return int(getattr(config, self.interleave)) if self.interleave is not None else 1

    def rows(self, n_rows: int, config: object = None) -> torch.Tensor | None:
        """Indices of this sublayer's rows among a module's ``n_rows`` output rows (None: all of them)."""
        if self.chunk is None:
            return None
        i, n = self.chunk
        groups = self.groups(config)
        size = n_rows // (groups * n)
        starts = torch.arange(groups) * (n_rows // groups) + i * size
        return (starts[:, None] + torch.arange(size)[None, :]).reshape(-1)


@dataclass(frozen=True)
class HeadSpec:
    """The MLM head: modules of the ForMaskedLM model (paths relative to it) applied in turn.

    The chain maps the base model's last hidden state (B, T, H), after the final norm, to logits
    (B, T, V) exactly as the model's own ``forward`` does. ``call`` (rare) replaces the chain for a
    head that needs more than the hidden state: ``call(model, hidden) -> logits``.
    """

    modules: tuple[str, ...] = ("cls",)
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    in_base_model: tuple[str, ...] = ()
    """Head modules that sit inside the base model (LLaDA's ``ff_out``; paths relative to the model, a missing one
    skipped): ``gradflow check`` counts their calls at the loss positions, as the head's, not as encoder compute."""

    def function(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """``hidden (..., H) -> logits (..., V)`` for ``model``; LookupError if a module is missing."""
        if self.call is not None:
            return lambda hidden: self.call(model, hidden)
        chain = [get_module(model, path) for path in self.modules]

        def head(hidden: torch.Tensor) -> torch.Tensor:
            for module in chain:
                hidden = module(hidden)
            return hidden

        return head

    def describe(self) -> str:
        """The chain as text, for messages."""
        return f"{self.call.__name__}(model, hidden)" if self.call is not None else " -> ".join(self.modules)


LM_HEAD = HeadSpec(("lm_head",))
"""The RoBERTa-style head (``lm_head``), also used by ESM, MPNet and the pre-LN RoBERTa variants."""


@dataclass(frozen=True)
class Adapter:
    """Where one architecture family keeps its parts (paths relative to ``model.base_model``).

    ``blocks``: path of the ``ModuleList`` of blocks. ``mid``: (path inside a block, "output" or
    "input") of the residual stream after attention and before the FFN. ``attn_norm``: "post" when
    the attention LayerNorm follows attention (post-LN BERT), "pre" when it feeds Q, K and V.
    ``expand_blocks`` (rare): a function ``(base_model) -> list of block modules in call order``
    for models that apply one module several times (ALBERT); otherwise ``blocks`` is used as is.

    The remaining fields default to the BERT layout:

    - ``head``: the MLM head (default ``cls``, BERT's);
    - ``final_norm``: path of the norm between the last block and the head (pre-LN families), or None;
    - ``positions_after_padding``: learned position ids start at ``pad_token_id + 1`` (RoBERTa);
    - ``per_layer_config``: config attributes holding one entry per block (ModernBERT's
      ``layer_types``), cut to the kept blocks when blocks are dropped;
    - ``drop_blocks`` (rare): ``(model, k) -> (parameters removed, note)`` removes the last ``k``
      depths; default: delete the last ``k`` entries of the ``blocks`` ModuleList;
    - ``drop_extras`` (rare): ``(model, before, after) -> note`` resizes per-layer modules outside
      the blocks (ESM's contact head) after blocks were dropped;
    - ``init_block`` (rare): ``(model, block) -> None`` re-initialises one block in place from the
      torch RNG; default: the model's own ``_init_weights`` on every submodule;
    - ``unshare`` (weight-sharing families): ``(model) -> None`` gives every depth its own copy of its
      block, keeping the outputs; None for families whose blocks are never shared;
    - ``embeddings_at``: ``"output"``: ``embeddings.out`` is the ``embeddings`` module's output;
      ``"blocks"`` (the generic adapter): it is the first block's input, and ``embeddings`` names
      the module whose call starts a forward (``""``: the base model itself).
    - ``subset_block`` (sparse MLM training, :mod:`gradflow.training`): ``(block, call, index) ->
      (B, n, H)`` runs the last block with queries only at ``index`` (B, n) (keys and values at every
      position); ``call``: the block call's arguments by name; None: not implemented for the family;
    - ``head_mixes_positions``: why the MLM head is not position-wise (a reason refuses the sparse
      head); None: the head maps each position's hidden state alone;
    - ``run_whole_model``: why the base model cannot be called alone with the batch's inputs to give the
      last hidden state (LLaDA's base model applies the head and returns logits; Dream's takes the 4-D mask
      its whole model builds); the recorder then runs the whole model, and sparse training intercepts the
      last block inside the whole model's forward (the head is still position-wise); None: it can;
    - ``channels_first``: the blocks and the mid point carry (B, H, T) hidden states (SqueezeBERT): sites
      and sublayer inputs are transposed to (B, T, H); Conv1d sublayers of kernel size 1 are per-position Linears;
    - ``refuse`` (rare): ``(config) -> reason or None``: why a variant of the family cannot be recorded
      (I-BERT's ``quant_mode=True``); :func:`adapter_for` raises with the reason.

    ``mid`` is None when the mid point is unknown (the generic adapter): no ``mid`` sites then.
    """

    family: str
    model_types: tuple[str, ...]
    embeddings: str
    blocks: str
    mid: tuple[str, str] | None
    sublayers: dict[str, SublayerSpec]
    attn_norm: str = "post"
    expand_blocks: Callable[[nn.Module], list[nn.Module]] | None = field(default=None, compare=False)
    notes: str = ""
    head: HeadSpec = HeadSpec()
    final_norm: str | None = None
    positions_after_padding: bool = False
    per_layer_config: tuple[str, ...] = ()
    drop_blocks: Callable[[nn.Module, int], tuple[int, str]] | None = field(default=None, compare=False)
    drop_extras: Callable[[nn.Module, int, int], str] | None = field(default=None, compare=False)
    init_block: Callable[[nn.Module, nn.Module], None] | None = field(default=None, compare=False)
    unshare: Callable[[nn.Module], None] | None = field(default=None, compare=False)
    embeddings_at: str = "output"
    channels_first: bool = False
    refuse: Callable[[object], str | None] | None = field(default=None, compare=False)
    subset_block: Callable[[nn.Module, dict, torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    head_mixes_positions: str | None = None
    run_whole_model: str | None = None
    after_mixing_extra: tuple[str, ...] = ()
    """Non-standard sublayer names that, like ``attn.q`` and the FFN, read only their own position after the mixing."""
    appends_padding: bool = False
    """The model appends positions to the sequence inside forward (Longformer); the recorder gives them role pad."""
    sequence_first: tuple[str, ...] = ()
    """Sublayer names whose module reads (T, B, D) tensors (Longformer's q/k/v); recorded as (B, T, D)."""
    block_entry: str | None = None
    """Path in a block of the module whose first input is the block's input, for blocks never called as one module
    (XLM's parallel lists, gathered per depth by ``expand_blocks``): a block's output is then the next block's entry
    input, the last block's the base model's output."""
    block_exit: str | None = None
    """With ``block_entry``: path in a block of the module whose output is the block's output (SqueezeBERT's encoder
    calls ``layer.forward``, so the block's own hooks never run)."""
    subset_call: str | None = None
    """Path in the last block of the module whose call ``subset_block`` receives (``call``), for blocks the model never
    calls as one module (XLM's ``attentions``); None: the block's own call."""
    shifted_head: bool | None = False
    """The model was trained with a shifted head: the logits at position p predict the token at p + 1 (Dream's loss
    shifts the logits right by one), so only a shifted objective (labels and roles on the loss side: position p
    carries the loss of the token at p + 1) matches its training; False: the logits at p predict the token at p;
    None: unknown (the generic adapter), so either objective is taken."""
    experts: dict[str, ExpertsSpec] = field(default_factory=dict)
    """Mixture-of-experts blocks: name (``ffn.experts``) -> where the experts are and how they are called
    (:mod:`gradflow.adapters.experts`); each weight is split by the role of the rows routed to each expert, recorded
    as ``<name>.<parameter or Linear>``. An experts name in ``after_mixing_extra`` puts those in the after-mixing
    set."""
    routers: tuple[str, ...] = ()
    """Recorded names of the sublayers that route rows to ``experts`` where they are not ``ffn.router`` (the name the
    registered MoE adapters give theirs): the generic adapter's, by module path (``mlp.gate``)."""
    router_aux: RouterAuxSpec | None = None
    """How the model computes its auxiliary router loss (load balancing), which its training adds to the loss
    (``gradflow record --router-aux-loss``); None: none known."""
    two_pass: TwoPassSpec | None = None
    """A prompt pass and a canvas pass through tied blocks (DiffusionGemma; :mod:`gradflow.adapters.two_pass`):
    ``blocks`` are the canvas pass's, and the recorder joins both passes' calls of each depth into one block."""

    def after_mixing(self) -> tuple[str, ...]:
        """Sublayers of a block that see only the channel's own post-attention state.

        In the last block these receive exactly zero gradient from non-loss channels.
        """
        names = ["attn.q", "attn.out", "ffn.in", "ffn.gate", "ffn.out", "ffn.norm"]
        if self.attn_norm == "post":
            names.append("attn.norm")
        standard = tuple(n for n in SUBLAYER_NAMES if n in names and n in self.sublayers)
        experts = tuple(n for name, spec in self.experts.items() if name in self.after_mixing_extra
                        for n in spec.names(name))
        return standard + tuple(n for n in self.after_mixing_extra if n in self.sublayers) + experts

    def router_names(self) -> tuple[str, ...]:
        """The recorded names of the routers of a mixture-of-experts model (``ffn.router`` where a registered adapter
        has one, and ``routers``); empty for a dense model."""
        if not self.experts:
            return ()
        return tuple(dict.fromkeys((*(("ffn.router",) if "ffn.router" in self.sublayers else ()), *self.routers)))

    def position_offset(self, config) -> int:
        """Learned position embeddings before the first one a token uses (RoBERTa: ``pad_token_id + 1``)."""
        return (getattr(config, "pad_token_id", None) or 0) + 1 if self.positions_after_padding else 0


def get_module(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)`` with an error that names the missing path."""
    if not path:
        return root
    try:
        return root.get_submodule(path)
    except AttributeError as err:
        raise LookupError(f"module path {path!r} not found in {type(root).__name__}: {err}") from None


def block_modules(adapter: Adapter, base: nn.Module) -> list[nn.Module]:
    """The blocks in call order (a module may repeat, e.g. ALBERT's shared layer)."""
    if adapter.expand_blocks is not None:
        return adapter.expand_blocks(base)
    return list(get_module(base, adapter.blocks))


def count_parameters(modules: Iterable[nn.Module]) -> int:
    """Number of parameter elements in ``modules``, each shared parameter counted once."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total
