"""Loading masked LMs: embedded models (the core pair in this folder, the others in the companion distribution
gradflow-models), ``zoo:NAME``, local paths, hub names."""

from gradflow.models.embedded import COMPANION, CORE_MODELS, installed_embedded_models
from gradflow.models.loading import (
                                      DEFAULT_MODEL,
                                      DTYPES,
                                      EMBEDDED_MODELS,
                                      LoadedModel,
                                      embedded_model_dir,
                                      load_model,
                                      resolve_model_path,
)

__all__ = ["COMPANION", "CORE_MODELS", "DEFAULT_MODEL", "DTYPES", "EMBEDDED_MODELS", "LoadedModel",
           "embedded_model_dir", "installed_embedded_models", "load_model", "resolve_model_path"]
