"""gradflow: where the training signal of a masked language model goes.

The public API, re-exported from the modules that define it.
"""

from gradflow.adapters import Adapter, SublayerSpec, adapter_for, register_adapter, supported_model_types
from gradflow.errors import GradflowError
from gradflow.explore.view import ChannelView, channel_view
from gradflow.hooks.recorder import BatchRecord, GradFlowRecorder, RecorderConfig, RecorderError
from gradflow.inputs.masking import BertMasking, ExplicitMasking, MaskedBatch, TokenizerInfo, mask_batch
from gradflow.losses import all_positions_loss, mlm_loss
from gradflow.models import LoadedModel, load_model
from gradflow.roles import ALL_ROLES, LOSS_ROLES, TOKEN_ROLES, Role

__version__ = "0.1.0"

__all__ = [
    "ALL_ROLES", "LOSS_ROLES", "TOKEN_ROLES", "Adapter", "BatchRecord", "BertMasking", "ChannelView", "ExplicitMasking",
    "GradFlowRecorder", "GradflowError", "LoadedModel", "MaskedBatch", "RecorderConfig", "RecorderError", "Role", "SublayerSpec",
    "TokenizerInfo", "__version__", "adapter_for", "all_positions_loss", "channel_view", "load_model", "mask_batch", "mlm_loss",
    "register_adapter", "supported_model_types",
]
