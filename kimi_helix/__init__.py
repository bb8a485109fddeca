"""kimi_helix: Kimi-K3-style hybrid language models (KDA + MLA + sigmoid-routed MoE).

Importing the package registers `KimiK3Config` ("kimi_k3") with AutoConfig, AutoModel and AutoModelForCausalLM,
and routes Kimi-Linear checkpoints (`model_type: kimi_linear`) loaded through AutoModel/AutoModelForCausalLM to
kimi_helix's implementation. It also registers the DSpark drafter (`dspark`) with AutoConfig and AutoModel.
"""

from .engine import LLM, SamplingParams
from .engine.planner import plan_memory
from .modeling import (
    CheckpointError,
    KimiK3Cache,
    KimiK3Config,
    KimiK3ForCausalLM,
    KimiK3Model,
    KimiK3PreTrainedModel,
)
from .modeling.registration import register_auto_classes

register_auto_classes()
from .speculative import dspark as _dspark  # noqa: E402, F401  (registers "dspark" with the Auto classes)

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "plan_memory",
    "CheckpointError",
    "KimiK3Cache",
    "KimiK3Config",
    "KimiK3ForCausalLM",
    "KimiK3Model",
    "KimiK3PreTrainedModel",
]
