"""The DSpark drafter (DeepSpec's standalone linear-chain drafter): config, model and target-feature capture.

Importing this package registers `DSparkConfig` ("dspark") and `DSparkDrafter` with AutoConfig and AutoModel.
"""

from transformers import AutoConfig, AutoModel

from .capture import TargetFeatureCapture
from .config import DSparkConfig, default_target_layer_ids
from .model import Draft, DSparkDrafter, DSparkOutput, SlotContext

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)

__all__ = [
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkOutput",
    "Draft",
    "SlotContext",
    "TargetFeatureCapture",
    "default_target_layer_ids",
]
