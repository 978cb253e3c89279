"""Loading masked LMs: embedded models (shipped in this folder), ``zoo:NAME``, local paths, hub names."""

from gradflow.models.loading import (
                                     DEFAULT_MODEL,
                                     DTYPES,
                                     EMBEDDED_MODELS,
                                     LoadedModel,
                                     embedded_model_dir,
                                     load_model,
                                     resolve_model_path,
)

__all__ = ["DEFAULT_MODEL", "DTYPES", "EMBEDDED_MODELS", "LoadedModel", "embedded_model_dir", "load_model",
           "resolve_model_path"]
