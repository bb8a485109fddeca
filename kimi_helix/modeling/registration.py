"""Registration with transformers' Auto classes.

`kimi_k3` maps to our classes. `kimi_linear` (Kimi-Linear checkpoints) maps to thin subclasses whose config reads
a Kimi-Linear `config.json` as a `KimiK3Config`. From transformers 5.17 `kimi_linear` also names transformers' own
config, and AutoModel*.register silently ignores (5.17) or needs `exist_ok` for (5.24) a transformers config
class; overriding the AutoConfig entry works the same on every version.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config import KimiK3Config
from .model import KimiK3ForCausalLM, KimiK3Model


class KimiLinearConfig(KimiK3Config):
    """A Kimi-Linear `config.json` read as a `KimiK3Config`."""

    model_type = "kimi_linear"

    # transformers turns a config subclass without its own __init__ into a dataclass and generates one, which
    # would skip KimiK3Config's parsing; this keeps it.
    def __init__(self, **kwargs):
        super().__init__(**kwargs)


class KimiLinearModel(KimiK3Model):
    config_class = KimiLinearConfig


class KimiLinearForCausalLM(KimiK3ForCausalLM):
    config_class = KimiLinearConfig


def register_auto_classes() -> None:
    """Route `kimi_k3` and `kimi_linear` checkpoints loaded through the Auto classes to kimi_helix."""
    for config, model, causal_lm in (
        (KimiK3Config, KimiK3Model, KimiK3ForCausalLM),
        (KimiLinearConfig, KimiLinearModel, KimiLinearForCausalLM),
    ):
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModel.register(config, model, exist_ok=True)
        AutoModelForCausalLM.register(config, causal_lm, exist_ok=True)
