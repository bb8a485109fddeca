"""Configuration, layers, model and cache of Kimi-K3-style hybrid models."""

from .cache import KimiK3Cache
from .checkpoint import CheckpointError
from .config import ConfigError, KimiK3Config
from .model import KimiK3ForCausalLM, KimiK3Model, KimiK3PreTrainedModel

__all__ = [
    "CheckpointError",
    "ConfigError",
    "KimiK3Cache",
    "KimiK3Config",
    "KimiK3ForCausalLM",
    "KimiK3Model",
    "KimiK3PreTrainedModel",
]
