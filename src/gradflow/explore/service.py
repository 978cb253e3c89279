"""What the explorer server does with a request, without the web: validate, compute one view at a time.

:class:`ExploreService` holds the models named at start-up (loaded by ``load_all`` or on first use, never a path
sent by the page, never with remote code), checks every request field and answers with a
:class:`ChannelView` or an :class:`ExploreError` whose message is one sentence for the page. One
computation runs at a time, always on the service's one compute thread (a computation on each web worker
thread left each of those threads holding a few MB of allocator and thread-pool state: resident memory grew with
every flood that woke new workers); at most ``max_waiting`` more wait, further requests are told to retry.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gradflow.errors import ExploreError, GradflowError
from gradflow.explore.view import LOSSES, ChannelView, channel_view
from gradflow.inputs.masking import MaskingPolicy
from gradflow.models import LoadedModel, load_model
from gradflow.models.embedded import installed_embedded_models
from gradflow.models.zoo import first_example

DEFAULT_TEXT = "The progress of public credit is witnessed by a considerable rise of American stock abroad."
EXPORT_FORMATS: dict[str, str] = {"png": "image/png", "pdf": "application/pdf", "csv": "text/csv"}
"""Export formats and their media types."""


@dataclass
class ExploreConfig:
    """The explorer's limits. ``models``: names the page may choose (embedded, ``zoo:NAME``, local
    directories); ``max_tokens``: longest sentence in tokens, special tokens included;
    ``max_chars``: longest text accepted before tokenising; ``max_waiting``: requests that may wait."""

    models: Sequence[str] = field(default_factory=lambda: tuple(installed_embedded_models()))
    max_tokens: int = 64
    max_chars: int = 600
    max_waiting: int = 4
    device: str = "cpu"
    objective: MaskingPolicy | None = None  # what "random" masking draws (None: BERT's 15%)


@dataclass
class ExploreService:
    """Answers the explorer's requests (see the module docstring). ``loader``: how a model is loaded."""

    config: ExploreConfig = field(default_factory=ExploreConfig)
    loader: Callable[[str], LoadedModel] | None = None
    _models: dict[str, LoadedModel] = field(default_factory=dict, init=False, repr=False)
    _compute: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "gradflow-explore"),
                                         init=False, repr=False)
    _count: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _waiting: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.config.models:
            raise ExploreError("name at least one model for the explorer.")

    # ------------------------------------------------------------------ requests
    def view(self, request: object) -> ChannelView:
        """Validate a request (``model``, ``text``, ``mask``, ``seed``, ``loss``) and compute its view."""
        if not isinstance(request, dict):
            raise ExploreError("the request must be a JSON object with the fields model, text, mask, seed and loss.")
        model = self._model_name(request.get("model", self.config.models[0]))
        text = self._text(request.get("text"))
        loss = request.get("loss", "mlm")
        if loss not in LOSSES:
            raise ExploreError(f"unknown loss {loss!r}; choose one of: {', '.join(LOSSES)}.")
        seed = request.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ExploreError(f"seed must be a whole number from 0 to {2**32 - 1}, got {seed!r}.")
        mask = _mask(request.get("mask", []))
        return self._run(lambda: self._compute_view(model, text, mask, seed, loss))

    def export(self, request: dict, fmt: str) -> bytes:
        """The current view as PNG or PDF (the project's own figure) or CSV (its numbers)."""
        if fmt not in EXPORT_FORMATS:
            raise ExploreError(f"unknown export format {fmt!r}; choose one of: {', '.join(EXPORT_FORMATS)}.")
        view = self.view(request)
        if not view.has_gradient:
            raise ExploreError(f"nothing to export yet: {view.notice}")
        with tempfile.TemporaryDirectory() as tmp:
            if fmt == "csv":
                return view.to_csv(Path(tmp) / "channel_view.csv").read_bytes()
            return self._run(lambda: view.save(Path(tmp) / "channel_view", formats=[fmt]))[0].read_bytes()

    # ------------------------------------------------------------------ checks
    def _model_name(self, name: object) -> str:
        if not isinstance(name, str) or name not in self.config.models:
            raise ExploreError(f"unknown model {name!r}: this explorer was started with "
                               f"{', '.join(self.config.models)}; restart it with --model to add another.", 404)
        return name

    def _text(self, text: object) -> str:
        if not isinstance(text, str) or not text.strip():
            raise ExploreError("type a sentence first: the text is empty.")
        if len(text) > self.config.max_chars:
            raise ExploreError(f"the text has {len(text)} characters; the explorer takes at most "
                               f"{self.config.max_chars}: shorten it to one sentence.", 413)
        return text

    # ------------------------------------------------------------------ computation
    def _compute_view(self, model: str, text: str, mask: list[int] | str, seed: int, loss: str) -> ChannelView:
        loaded = self._load(model)
        n_tokens = len(loaded.tokenizer(text)["input_ids"])
        limit = min(self.config.max_tokens, loaded.max_positions())
        if n_tokens > limit:
            raise ExploreError(f"the sentence has {n_tokens} tokens (special tokens included); the explorer shows at "
                               f"most {limit}: shorten it.", 413)
        try:
            return channel_view(loaded, text, mask=mask, seed=seed, loss=loss, objective=self.config.objective)
        except GradflowError as err:
            raise ExploreError(str(err)) from None

    def _load(self, name: str) -> LoadedModel:
        if name not in self._models:
            loader = self.loader or (lambda spec: load_model(spec, device=self.config.device))
            try:
                self._models[name] = loader(name)
            except GradflowError as err:
                raise ExploreError(f"model {name} could not be loaded: {err}", 500) from None
        return self._models[name]

    def _run(self, work: Callable[[], object]):
        """Run ``work`` on the compute thread, one at a time; refuse when ``max_waiting`` requests already wait."""
        with self._count:
            if self._waiting > self.config.max_waiting:
                raise ExploreError(f"the explorer is busy with {self._waiting} requests; try again in a moment.", 503)
            self._waiting += 1
        try:
            return self._compute.submit(work).result()
        finally:
            with self._count:
                self._waiting -= 1

    def load_all(self, progress: Callable[[str], None] | None = None) -> None:
        """Load every model named at start-up now, so that a typo or an unreachable hub stops the command
        before the page is served (``progress`` is told each name first)."""
        for name in self.config.models:
            if progress is not None:
                progress(name)
            self._load(name)

    def models(self) -> list[str]:
        """The model names the page may choose."""
        return list(self.config.models)

    def examples(self) -> dict[str, str]:
        """A sentence to start from per model: a zoo model's first shipped sequence (cut to ``max_tokens - 2``
        characters, which tokenizes within the cap for character-level vocabularies), else an English sentence."""
        examples = {}
        for model in self.config.models:
            shipped = first_example(model)
            examples[model] = shipped[: self.config.max_tokens - 2] if shipped else DEFAULT_TEXT
        return examples


def _mask(mask: object) -> list[int] | str:
    """``"random"``, or a list of distinct token positions (whole numbers)."""
    if mask == "random":
        return "random"
    if mask is None:
        return []
    if not isinstance(mask, list) or any(isinstance(p, bool) or not isinstance(p, int) for p in mask):
        raise ExploreError(f"mask must be 'random' or a list of token positions (whole numbers), got {mask!r}.")
    return sorted(set(mask))


__all__ = ["DEFAULT_TEXT", "EXPORT_FORMATS", "ExploreConfig", "ExploreService"]
