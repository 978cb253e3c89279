"""The keys of gradflow's JSON outputs, each with its meaning: ``gradflow check --json`` and a record run's meta.json.

Part of the ``schema`` unit (re-exported by :mod:`gradflow.schema_reports`, which says what every table column
means): :data:`CHECK_JSON_KEYS` and :data:`RECORD_META_KEYS` name every key as a path (``params[].flagged``;
``counts.skipped.empty_documents``; a map keyed by role is written ``batch.tokens.<role>``), and
:func:`undeclared_keys` finds the paths of a JSON value that a declaration lacks (the tests run every command on
a tiny model and fail on one).
"""

from __future__ import annotations

from collections.abc import Mapping

from gradflow.schema import WEIGHT_SHARING_META_KEY

CHECK_JSON_KEYS: dict[str, str] = {
    "model": "the model as given (name or portable path)",
    "model_type": "the config's ``model_type``",
    "family": "the adapter family",
    "attn_norm": "``post`` or ``pre``: where the block's norms sit",
    "num_blocks": "L, the number of block applications (depths)",
    "batch": "the one masked batch checked",
    "batch.texts": "the corpus (portable path)",
    "batch.seed": "masking seed (``--seed``)",
    "batch.masking": "the objective's masking policy, described as in meta.json (policy, parameters, ``shift``)",
    "batch.batch_size": "``--batch-size``: sequences asked for",
    "batch.max_length": "``--max-length`` in tokens",
    "batch.sequences": "sequences in the batch",
    "batch.tokens": "positions per role in the batch",
    "batch.tokens.<role>": "positions of the role (count)",
    "batch.loss": "the batch's loss under the objective (BERT: mean over its loss positions; diffusion: 1/t "
                  "weighted, the reference normalisation; nats)",
    "params": "one object per (layer, sublayer, param)",
    "params[].layer": "1..L",
    "params[].sublayer": "standard sublayer name, or the module path of another Linear/norm of the block",
    "params[].param": "``weight`` or ``bias`` (or the module's parameter name)",
    "params[].standard": "true for a standard sublayer",
    "params[].n_positions": "positions per present role",
    "params[].n_positions.<role>": "positions of the role (count)",
    "params[].positions_nonzero": "per present role, positions whose contribution is non-zero",
    "params[].positions_nonzero.<role>": "that count for the role",
    "params[].contribution": "per present role, ||G_r||_F: the Frobenius norm of its part of the parameter's gradient",
    "params[].contribution.<role>": "||G_r||_F of the role (the units of the parameter's gradient)",
    "params[].zero_roles": "roles whose contribution is exactly 0.0",
    "params[].context_zero": "context's contribution is exactly 0.0 (null without context positions)",
    "params[].loss_nonzero": "a loss role's contribution is non-zero",
    "params[].flagged": "``context_zero`` and ``loss_nonzero``: structurally untrained on context channels",
    "sublayers": "one object per (layer, sublayer)",
    "sublayers[].layer": "1..L",
    "sublayers[].sublayer": "the sublayer's name",
    "sublayers[].params": "its parameters' names",
    "sublayers[].standard": "true for a standard sublayer",
    "sublayers[].flagged": "every parameter is flagged",
    "sublayers[].expected_zero": "the theory's answer (null outside the standard sublayers)",
    "sublayers[].agrees": "``flagged == expected_zero`` (null outside the theory)",
    "sublayers[].shared_layers": "the layers applying the same module ([] when not shared)",
    "unsplit": "block parameters without a per-role measurement",
    "unsplit[].layer": "1..L",
    "unsplit[].parameter": "the parameter's path in the block",
    "unsplit[].reason": "why it cannot be split",
    "theory": "measurement against the theory (after the last attention, the last block gets no context gradient)",
    "theory.last_block_expected_zero": "the adapter's sublayers after mixing",
    "theory.agreements": "(layer, sublayer) pairs where measurement and theory agree",
    "theory.agreements[].layer": "1..L",
    "theory.agreements[].sublayer": "the sublayer's name",
    "theory.agreements[].expected_zero": "the theory's answer",
    "theory.agreements[].measured_zero": "the measured flag",
    "theory.disagreements": "pairs where they disagree (same fields as ``agreements``)",
    "theory.disagreements[].layer": "1..L",
    "theory.disagreements[].sublayer": "the sublayer's name",
    "theory.disagreements[].expected_zero": "the theory's answer",
    "theory.disagreements[].measured_zero": "the measured flag",
    "theory.agree": "no disagreement",
    "flops": "forward + backward matmul FLOPs of the batch (see gradflow.runs.check_flops)",
    "flops.tokens": "N, the non-padding positions (count)",
    "flops.loss_tokens": "N_loss, the loss positions (count)",
    "flops.unselected_tokens": "N - N_loss (count)",
    "flops.blocks_linear": "the blocks' Linear FLOPs (a term of ``total``)",
    "flops.attention": "the attention score and mixing FLOPs (a term of ``total``)",
    "flops.encoder_other": "Linear FLOPs of the encoder outside the blocks (a term of ``total``)",
    "flops.head": "the MLM head's FLOPs at the loss positions (a term of ``total``)",
    "flops.non_token": "FLOPs on non-token inputs such as relative positions (a term of ``total``)",
    "flops.head_unselected": "a dense head's extra FLOPs at the unselected positions (not in ``total``)",
    "flops.total": "forward + backward matmul FLOPs of the batch",
    "flops.skippable_sublayers": "the last block's zero-context Linear sublayers",
    "flops.skippable": "their FLOPs at the unselected positions",
    "flops.skippable_attention": "the last block's attention rows of the unselected queries (FLOPs)",
    "flops.share": "``skippable / total`` (1)",
    "flops.share_with_attention": "``(skippable + skippable_attention) / total`` (1)",
    "skippable_share": "``flops.share``, the headline number (1)",
    "notes": "sentences on what the batch could not show, and on weight sharing",
    "shared_parameters": "empty unless the last block's module is applied at earlier depths; then one per parameter "
                         "flagged in the last block (a zero per application)",
    "shared_parameters[].sublayer": "a sublayer flagged in the last block",
    "shared_parameters[].param": "its parameter",
    "shared_parameters[].layers": "every layer 1..L applying the module",
    "shared_parameters[].total_context_share": "context's part of the per-position magnitudes summed over all those "
                                               "applications (1; all roles sum to 1): how much of the shared "
                                               "parameter's training signal comes from context",
}
"""Every key of ``gradflow check --json``, as a path: ``a.b`` a key of object ``a``, ``a[]`` an element of list
``a``, ``.<role>`` a map keyed by role names."""

RECORD_META_KEYS: dict[str, str] = {
    "complete": "true when the whole corpus was recorded; false when the job stopped early (Ctrl-C: exit 130)",
    "error": "what stopped the job early (null when complete)",
    "model": "the model as given (name, ``zoo:NAME`` or portable path)",
    "model_path": "where it was loaded from (portable path)",
    "family": "the adapter family",
    "model_type": "the config's ``model_type``",
    "config_hash": "hash of the model's config",
    "num_layers": "L, the number of block applications",
    "texts": "the corpus (portable path)",
    "inputs_sha256": "content hash of each input outside the package, cache and repository (only then)",
    "masking": "the masking policy's description (policy: bert, span, diffusion or explicit; its parameters; "
               "``shift`` when shifted)",
    "seed": "the masking seed (``--seed``)",
    "versions": "python, torch, transformers, gradflow and gradflow_revision (a checkout's git commit or unknown)",
    "command": "the exact command line (paths portable)",
    "wall_s": "wall time of the job in seconds",
    "attn_norm": "``post`` or ``pre``",
    "after_mixing_sublayers": "the sublayers the theory says the last block trains on no context",
    "tokenizer": "the tokenizer: ``name_or_path``, ``vocab_size``, ``hash``",
    "loss": "the loss (``mlm`` or ``all-positions``)",
    "reduction": "``sequence`` (sum of each sequence's mean loss) or ``batch``",
    "max_length": "window length in tokens",
    "batch_size": "sequences per batch",
    "limit": "``--limit`` (null: no limit)",
    "device": "the device recorded on",
    "dtype": "the model's dtype",
    "world_size": "processes (torchrun / accelerate)",
    "sharding": "``--shard fsdp2`` runs only: how the model was sharded across the ranks",
    "sharding.kind": "``fsdp2`` (``torch.distributed.fsdp.fully_shard``; batches dealt whole to the ranks)",
    "sharding.world_size": "ranks the parameters are sharded over",
    "sharding.units": "FSDP2 units: each block whose parameters are its own, plus the root (embeddings, head)",
    "sharding.blocks_in_root": "blocks left in the root unit because a parameter of theirs is shared outside them",
    "counts": "what was read and recorded",
    "counts.documents": "documents read",
    "counts.windows": "windows of at most max_length tokens",
    "counts.split_documents": "documents longer than one window",
    "counts.truncated_responses": "prompt/response corpora only: responses cut to fit the window",
    "counts.sequences_recorded": "sequences recorded",
    "counts.batches": "batches recorded",
    "counts.tokens_per_role": "positions per role (pad included)",
    "counts.skipped": "what was skipped and why",
    "counts.skipped.empty_documents": "documents with no token",
    "counts.skipped.nonfinite_batches": "batches whose loss or a norm was NaN/inf (never averaged in)",
    "counts.skipped.nonfinite_sequences": "their sequences",
    "counts.skipped.reason_nonfinite": "the sentence saying so",
    "mean_loss": "the batch loss (under ``reduction``: with ``sequence``, a sum of the batch's sequence means, "
                 "nats) averaged over the recorded batches",
    WEIGHT_SHARING_META_KEY: "shared blocks only: ``{shared_layers: [[layers applying one module], ...]}``",
    "prompted": "prompt/response corpora only (``--prompt-field``): ``{prompt_field, response_field}``; the prompt "
                "is never masked",
    "prompted.prompt_field": "the jsonl field holding the prompt",
    "prompted.response_field": "the jsonl field holding the response",
    "two_pass": "two-pass models only (DiffusionGemma): how each window was split into prompt and canvas",
    "two_pass.canvas_length": "C, the canvas length: a plain window's last min(C, n - 1) tokens are the canvas, a "
                              "prompt/response pair's response cut to its first C tokens (``--canvas-length``)",
    "two_pass.canvas_length_from": "``--canvas-length`` or ``config`` (the model config's ``canvas_length``)",
    "routers": "mixtures of experts only: the recorded names of the sublayers that route rows to the experts "
               "(``ffn.router`` for gradflow's MoE adapters; the generic adapter's by module path, e.g. ``mlp.gate``)",
    "router_aux_loss": "``--router-aux-loss`` only: the auxiliary router loss added to the loss (its gradient split "
                       "by the role of the position each router row came from, like the loss's)",
    "router_aux_loss.requested": "``model`` (the model's own coefficient) or the coefficient given",
    "router_aux_loss.coefficient": "the coefficient the auxiliary loss was multiplied by",
    "router_aux_loss.mean_term": "the term added (coefficient times auxiliary loss) averaged over the recorded batches",
    "router_aux_loss.table": "the table of each router's and experts weight's gradient norm, loss vs auxiliary term",
    "progress": "unfinished runs only: what the last durable checkpoint holds (``gradflow record --resume``)",
    "progress.sequences": "sequences the last checkpoint holds (this process's)",
    "progress.windows": "windows read up to it, corpus-wide index (the next window to read)",
    "progress.checkpoint_utc": "when it was written (UTC, ISO 8601, seconds)",
}
"""meta.json's keys in a record run (``a.b``: key ``b`` of object ``a``; ``masking``, ``versions``,
``tokenizer``, ``counts.tokens_per_role`` and ``inputs_sha256`` are described as wholes)."""


def undeclared_keys(value: object, declared: Mapping[str, str], roles: tuple[str, ...], path: str = "") -> list[str]:
    """The paths in the JSON ``value`` that ``declared`` (as :data:`CHECK_JSON_KEYS`) does not name; an object
    declared as a whole (no ``path.key`` declared under it) is not walked."""
    out: list[str] = []
    if isinstance(value, list):
        for item in value:
            out += undeclared_keys(item, declared, roles, f"{path}[]")
    elif isinstance(value, dict) and (not path or any(k.startswith((f"{path}.", f"{path}[")) for k in declared)):
        for key, item in value.items():
            role_path = f"{path}.<role>" if path else "<role>"
            child = role_path if role_path in declared and key in roles else (f"{path}.{key}" if path else key)
            out += [child] if child not in declared else undeclared_keys(item, declared, roles, child)
    return sorted(set(out))


__all__ = ["CHECK_JSON_KEYS", "RECORD_META_KEYS", "undeclared_keys"]
