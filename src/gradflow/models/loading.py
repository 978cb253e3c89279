"""Loading masked LMs by name or path: embedded models, ``zoo:NAME``, local directories, hub names.

Loading never runs code from a checkpoint: ``trust_remote_code`` is off unless the caller passes
it explicitly, and weights load through safetensors (or ``torch.load(weights_only=True)``, which
transformers uses for ``.bin`` files). A local checkpoint whose ``config.json`` names its own code
(``auto_map``) is refused before transformers reads it unless ``trust_remote_code`` is passed.

The model class is the masked-LM one (``AutoModelForMaskedLM``). Remote code that registers only
``AutoModel`` (masked diffusion LMs: LLaDA, Dream) is loaded with ``AutoModel`` instead, with
``trust_remote_code`` only, and kept only if a probe forward returns ``logits`` of one row per
position over the vocabulary. A tokenizer that declares no mask token while the config gives
``mask_token_id`` (some LLaDA tokenizers) gets that token as its mask token, with a notice.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gradflow.adapters import (
    ADAPTER_CHOICES,
    Adapter,
    UnsupportedArchitectureError,
    adapter_for,
    discover_adapter,
    registered_family,
)
from gradflow.adapters.refusals import refusal
from gradflow.errors import ModelLoadError
from gradflow.models import zoo
from gradflow.models.buffers import non_persistent_buffers, rebuild_non_persistent_buffers
from gradflow.models.embedded import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    embedded_model_dir,  # noqa: F401 - re-exported (its home before issue 52)
    find_embedded_model,
)
from gradflow.models.quiet import quiet_transformers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for recording: the module (eval mode), its tokenizer and provenance."""

    model: nn.Module
    tokenizer: object
    name: str
    path: str
    adapter: Adapter
    config_hash: str

    def max_positions(self) -> int:
        """Longest input (tokens, special tokens included) the model accepts."""
        return position_limit(getattr(self.tokenizer, "model_max_length", None),
                              getattr(self.model.config, "max_position_embeddings", None))

    def tokenizer_info(self) -> dict:
        """Name, vocabulary size and a hash of the vocabulary (for comparing runs per token)."""
        vocab = self.tokenizer.get_vocab()
        digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:16]
        return {"name_or_path": self.path, "vocab_size": len(self.tokenizer), "hash": digest}


def position_limit(tokenizer_limit: object, config_limit: object) -> int:
    """The longest input a model accepts: the tokenizer's ``model_max_length`` (unless unset: 10^6 or more) and the
    config's ``max_position_embeddings``, the smaller of the two given; 512 when neither is."""
    tokenizer_limit = tokenizer_limit if isinstance(tokenizer_limit, (int, float)) else None
    config_limit = config_limit if isinstance(config_limit, (int, float)) else None
    if tokenizer_limit is not None and tokenizer_limit < 1_000_000:
        return int(min(tokenizer_limit, config_limit)) if config_limit else int(tokenizer_limit)
    return int(config_limit) if config_limit else 512


def resolve_model_path(spec: str) -> tuple[str, bool]:
    """(path or hub name, is_local) for a model spec; raises ModelLoadError for missing local paths."""
    if spec in EMBEDDED_MODELS:  # in the gradflow package or the companion gradflow-models, wherever installed
        return str(find_embedded_model(spec)), True
    if spec.startswith("zoo:"):
        return str(zoo.resolve(spec[4:])), True
    p = Path(spec).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"{spec} exists but has no config.json: pass a directory saved with "
                                 "save_pretrained (config.json, weights, tokenizer files).")
        return str(p), True
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or spec.endswith(("/", ".json", ".bin", ".safetensors")):
        raise ModelLoadError(f"model path {spec} does not exist. Pass an existing directory, an embedded model "
                             f"({', '.join(EMBEDDED_MODELS)}), zoo:NAME (see `gradflow zoo list`) or a hub name.")
    return spec, False


def load_model(spec: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32",
               trust_remote_code: bool = False, adapter: str = "registered",
               max_length: int | None = None) -> LoadedModel:
    """Load a ForMaskedLM model and its tokenizer; eval mode, on ``device``, in ``dtype``.

    ``adapter``: ``"registered"`` (the adapter of ``config.model_type``; refused without one) or
    ``"auto"`` (opt-in: the generic adapter discovered from the loaded model, with a notice on stderr).
    ``max_length``: the window the caller will use (``--max-length``), or None. A local checkpoint refused for
    its own code or for want of an adapter is refused with every flag its ``config.json`` and
    ``tokenizer_config.json``, read as JSON, say the next run needs: ``--adapter auto`` for a ``model_type``
    without an adapter, ``--max-length N`` when it accepts fewer positions than ``max_length``.
    """
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # gradflow shows its own progress; keep stderr for real messages

    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if adapter not in ADAPTER_CHOICES:
        raise ModelLoadError(f"unknown adapter {adapter!r}; choose one of {', '.join(ADAPTER_CHOICES)}")
    path, local = resolve_model_path(spec)
    code = _checkpoint_code(path) if local else []
    if code and not trust_remote_code:
        reasons, flags = _also_needed(path, adapter, max_length) if local else ([], [])
        more = f"; its files also say that {' and that '.join(reasons)}" if reasons else ""
        if flags:
            more += f": after the review, run it again with {' '.join(['--trust-remote-code', *flags])}"
        raise ModelLoadError(f"{spec!r} ships its own model code ({', '.join(code)}), which gradflow runs only with "
                             f"--trust-remote-code (trust_remote_code=True): review that code, then pass the flag{more}.")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:
        where = "the directory" if local else "the Hugging Face hub (is it reachable? set HF_HUB_OFFLINE=1 to use the local cache only)"
        raise ModelLoadError(f"could not load a config for {spec!r} from {where}: {err}") from None
    except ValueError as err:
        if not trust_remote_code and "trust_remote_code" in str(err):
            raise ModelLoadError(f"{spec!r} ships its own model code, which gradflow runs only with "
                                 "--trust-remote-code (trust_remote_code=True): review that code, then pass the "
                                 "flag.") from None
        raise ModelLoadError(f"could not read the config of {spec!r}: {err}. If the model needs custom code, "
                             "review it and pass --trust-remote-code.") from None
    try:
        found = adapter_for(config) if adapter == "registered" else None
    except UnsupportedArchitectureError as err:
        hint = ""
        if "does not hold" not in str(err):
            reasons, flags = _also_needed(path, "auto", max_length) if local else ([], [])
            hint = (" A model without an adapter may be recorded with the generic one, discovered from its modules: "
                    "pass --adapter auto.")
            if reasons:
                given = ["--trust-remote-code"] if code else []
                hint = (f"{hint[:-1]}; its files also say that {' and that '.join(reasons)}: run it again with "
                        f"{' '.join([*given, '--adapter auto', *flags])}.")
        raise ModelLoadError(f"{err}{hint}") from None
    own_class = found.two_pass.model_class if found is not None and found.two_pass is not None else None
    model, info, auto_model = _load_weights(spec, path, config, dtype, trust_remote_code, own_class)
    if type(model).__module__.startswith("transformers_modules"):  # remote code: its buffers (transformers#48892)
        _rebuild_buffers(model, spec)
    head_missing = [k for k in info.get("missing_keys", []) if not k.startswith(model.base_model_prefix + ".")]
    head_missing = [k for k in head_missing if not k.endswith("decoder.weight")]  # tied to the embeddings
    if head_missing:
        raise ModelLoadError(
            f"{spec!r} has no masked-LM head (missing {', '.join(sorted(head_missing)[:3])}): it looks like a "
            "bare encoder (e.g. BertModel). gradflow needs a ForMaskedLM checkpoint such as bert-base-uncased "
            "or roberta-base, whose MLM head was trained with the encoder."
        )
    encoder_missing = sorted(k for k in info.get("missing_keys", []) if k.startswith(model.base_model_prefix + "."))
    if encoder_missing:
        print(f"gradflow: warning: {len(encoder_missing)} encoder weight(s) of {spec!r} are not in the checkpoint and "
              f"were initialised at random ({', '.join(encoder_missing[:3])}{', ...' if len(encoder_missing) > 3 else ''}"
              "): gradients recorded through them describe an untrained part of the model.", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load the tokenizer of {spec!r}: {err}") from None
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        # transformers 5 builds an empty tokenizer (special tokens only) when a directory has no tokenizer files
        raise ModelLoadError(f"{spec!r} has no tokenizer (its vocabulary is only the {len(tokenizer)} special tokens): "
                             "save the tokenizer next to the weights (tokenizer.save_pretrained(DIR)) and retry.")
    if tokenizer.mask_token_id is None:
        _mask_token_from_config(tokenizer, config, spec)
    if tokenizer.mask_token_id is None:
        raise ModelLoadError(f"the tokenizer of {spec!r} has no mask token: it is not a masked-LM tokenizer.")
    model.to(device).eval()
    if auto_model:
        _check_returns_logits(model, tokenizer, spec)
    if found is None:
        try:
            found = discover_adapter(model)
        except UnsupportedArchitectureError as err:
            raise ModelLoadError(str(err)) from None
    config_hash = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    return LoadedModel(model, tokenizer, spec, path, found, config_hash)


def _rebuild_buffers(model: nn.Module, spec: str) -> None:
    """Recompute a remote-code model's non-persistent buffers (transformers 5 leaves them uninitialised)."""
    try:
        rebuild_non_persistent_buffers(model)
    except Exception as err:  # noqa: BLE001 - the class's own __init__ may raise anything; say what it means
        names = ", ".join(non_persistent_buffers(model)[:3])
        raise ModelLoadError(f"{spec!r}: its remote code keeps buffers outside the checkpoint ({names}) and rebuilding "
                             f"them from its config failed ({type(err).__name__}: {err}); without them its outputs "
                             "are computed from uninitialised memory under transformers 5 "
                             "(huggingface/transformers#48892). Report it with the checkpoint's name.") from None


def _checkpoint_code(path: str) -> list[str]:
    """The Python files a local checkpoint's ``config.json`` names in ``auto_map`` (its own code), sorted; empty when
    transformers knows its ``model_type`` (then transformers' own classes load it without that code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        auto_map = raw.get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return []
    if _known_to_transformers(raw.get("model_type"), CONFIG_MAPPING):
        return []
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(r, str)]
    return sorted({ref.split("--")[-1].rsplit(".", 1)[0] + ".py" for ref in refs})


def _also_needed(path: str, adapter: str, max_length: int | None) -> tuple[list[str], list[str]]:
    """(reasons, flags): what else a local checkpoint needs beyond the flag being asked for, read from its
    ``config.json`` and ``tokenizer_config.json`` as JSON (none of its code runs): ``--adapter auto`` when its
    ``model_type`` has no adapter (and ``adapter`` is not ``"auto"`` already), ``--max-length N`` when the positions
    its files give (:func:`position_limit`, only when they give one) are fewer than ``max_length``."""
    def read(name: str) -> dict:
        try:
            raw = json.loads((Path(path) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return raw if isinstance(raw, dict) else {}

    config, tokenizer = read("config.json"), read("tokenizer_config.json")
    reasons, flags = [], []
    kind = config.get("model_type")
    if adapter != "auto" and isinstance(kind, str) and registered_family(kind) is None:
        refused = refusal(kind)
        if refused is not None and refused.startswith("does not hold"):
            reasons.append(f"gradflow refuses model_type {kind!r} even then (see docs/mlm-coverage.md)")
            return reasons, []
        reasons.append(f"model_type {kind!r} has no gradflow adapter (the generic one, discovered from its modules, "
                       "is --adapter auto)")
        flags.append("--adapter auto")
    given = [v for v in (tokenizer.get("model_max_length"), config.get("max_position_embeddings"))
             if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1_000_000]
    if max_length is not None and given:
        limit = position_limit(tokenizer.get("model_max_length"), config.get("max_position_embeddings"))
        if limit < max_length:
            reasons.append(f"it accepts {limit} positions, fewer than --max-length {max_length}")
            flags.append(f"--max-length {limit}")
    return reasons, flags


def _known_to_transformers(kind: object, mapping) -> bool:
    """Whether transformers has classes of its own for this config type (not an architecture branch: any type)."""
    return isinstance(kind, str) and kind in mapping


def _load_weights(spec: str, path: str, config, dtype: str, trust_remote_code: bool,
                  own_class: str | None = None) -> tuple[nn.Module, dict, bool]:
    """(model, loading info, loaded with ``AutoModel``): the masked-LM class; failing that, ``AutoModel`` for remote
    code whose ``auto_map`` registers it (masked diffusion LMs: LLaDA, Dream), with ``trust_remote_code`` only;
    ``own_class``: the transformers class the adapter names (a two-pass model's: no masked-LM class maps it)."""
    import transformers
    from transformers import AutoModel, AutoModelForMaskedLM

    if own_class is not None:
        try:
            with quiet_transformers():
                model, info = getattr(transformers, own_class).from_pretrained(
                    path, config=config, dtype=DTYPES[dtype], output_loading_info=True)
        except OSError as err:
            raise ModelLoadError(f"could not load the weights of {spec!r}: {err}") from None
        return model, info, False

    auto_map = getattr(config, "auto_map", None) or {}
    fallback = trust_remote_code and "AutoModel" in auto_map and "AutoModelForMaskedLM" not in auto_map
    for auto_class in (AutoModelForMaskedLM, AutoModel) if fallback else (AutoModelForMaskedLM,):
        try:
            with quiet_transformers():  # its load report lists unused heads (pooler, NSP): noise; gradflow checks
                model, info = auto_class.from_pretrained(path, config=config, dtype=DTYPES[dtype],
                                                         trust_remote_code=trust_remote_code, output_loading_info=True)
            return model, info, auto_class is AutoModel
        except ValueError as err:
            if auto_class is AutoModelForMaskedLM and fallback:
                continue  # no masked-LM class for this config: its AutoModel class, checked for logits after loading
            raise ModelLoadError(_no_masked_lm_class(spec, config)) from None
        except OSError as err:
            raise ModelLoadError(f"could not load the weights of {spec!r}: {err}") from None
    raise AssertionError("unreachable")


def _no_masked_lm_class(spec: str, config) -> str:
    """The one-sentence refusal of a checkpoint whose type transformers maps to no masked-LM class (a causal LM, an
    encoder-decoder): what it is, and how a masked diffusion LM of that architecture is loaded instead."""
    named = ", ".join(getattr(config, "architectures", None) or []) or "no masked-LM architecture"
    return (f"{spec!r} (model_type {config.model_type!r}, {named}) has no masked-LM class in transformers, so it is "
            "not a model gradflow records: a masked LM or masked diffusion LM ships a masked-LM class, or remote code "
            "registered for AutoModel (LLaDA, Dream, LLaDA-MoE: load those with --trust-remote-code), or a "
            "DiffusionGemma class; see docs/mlm-coverage.md for the types it records.")


def _mask_token_from_config(tokenizer, config, spec: str) -> None:
    """Give a tokenizer without a mask token the one ``config.mask_token_id`` names (LLaDA: 126336), if any."""
    mask_id = getattr(config, "mask_token_id", None)
    if not isinstance(mask_id, int) or not 0 <= mask_id < len(tokenizer):
        return
    token = tokenizer.convert_ids_to_tokens(mask_id)
    if token is None or token == tokenizer.unk_token:
        return
    tokenizer.mask_token = token
    print(f"gradflow: the tokenizer of {spec!r} declares no mask token; using {token!r}, the config's mask_token_id "
          f"{mask_id}.", file=sys.stderr)


def _check_returns_logits(model: nn.Module, tokenizer, spec: str) -> None:
    """A model loaded with ``AutoModel`` must return ``logits`` (B, T, V >= the tokenizer's size) on a probe
    (``input_ids`` only: three mask tokens)."""
    ids = torch.tensor([[tokenizer.mask_token_id] * 3], device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            logits = getattr(model(input_ids=ids), "logits", None)
    except Exception as err:  # noqa: BLE001 - any failure of the probe forward is reported as a refusal
        raise ModelLoadError(f"{spec!r} was loaded with AutoModel (its config.json maps no masked-LM class) but a "
                             f"probe forward failed: {type(err).__name__}: {err}") from None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, 3) \
            or logits.shape[-1] < len(tokenizer):
        raise ModelLoadError(f"{spec!r} was loaded with AutoModel (its config.json maps no masked-LM class), but its "
                             "forward returns no logits over the vocabulary at each position: gradflow needs the "
                             "model with its language-model head.")
