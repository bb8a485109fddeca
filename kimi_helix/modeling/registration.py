"""Registration with transformers' Auto classes.

`kimi_k3` maps to our classes. Kimi-Linear checkpoints (`kimi_linear`) map to thin subclasses whose config class
is named `KimiLinearConfig`, which is how transformers' AutoModel keys its table: from transformers 5.17 the name
`kimi_linear` belongs to transformers' own config, and AutoModel*.register only accepts a model whose config
class has that name.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, CONFIG_MAPPING

from .config import KimiK3Config
from .model import KimiK3ForCausalLM, KimiK3Model


class KimiLinearConfig(KimiK3Config):
    """A Kimi-Linear `config.json` read as a `KimiK3Config`."""

    model_type = "kimi_linear"


class KimiLinearModel(KimiK3Model):
    config_class = KimiLinearConfig


class KimiLinearForCausalLM(KimiK3ForCausalLM):
    config_class = KimiLinearConfig


def register_auto_classes() -> None:
    AutoConfig.register("kimi_k3", KimiK3Config, exist_ok=True)
    AutoModel.register(KimiK3Config, KimiK3Model, exist_ok=True)
    AutoModelForCausalLM.register(KimiK3Config, KimiK3ForCausalLM, exist_ok=True)
    if "kimi_linear" in CONFIG_MAPPING:
        linear_config = CONFIG_MAPPING["kimi_linear"]  # transformers' own class
    else:
        AutoConfig.register("kimi_linear", KimiLinearConfig, exist_ok=True)
        linear_config = KimiLinearConfig
    AutoModel.register(linear_config, KimiLinearModel, exist_ok=True)
    AutoModelForCausalLM.register(linear_config, KimiLinearForCausalLM, exist_ok=True)
