"""Errors that gradflow reports to users as one clear paragraph (the CLI exits with code 2)."""


class GradflowError(Exception):
    """Bad input or an impossible request: the message says what was wrong and what to do."""


class CorpusError(GradflowError):
    """A corpus could not be read (missing, empty, not UTF-8, nothing maskable)."""


class ModelLoadError(GradflowError):
    """A model could not be loaded (missing path, no MLM head, unreachable hub)."""


class OutputDirError(GradflowError):
    """The output directory cannot be used (exists and is not empty without --overwrite)."""
