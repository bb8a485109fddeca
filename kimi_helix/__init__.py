"""kimi_helix: Kimi-K3-style hybrid language models (KDA + MLA + sigmoid-routed MoE).

The package imports lazily, so that `kimi-helix --help` starts without torch: `kimi_helix.LLM`,
`kimi_helix.KimiK3ForCausalLM`, ... and the submodules (`kimi_helix.presets`, ...) load on first use.

Registration with transformers' Auto classes (`KimiK3Config` as "kimi_k3" with AutoConfig, AutoModel and
AutoModelForCausalLM, and Kimi-Linear checkpoints, `model_type: kimi_linear`, routed to kimi_helix's
implementation) happens on `import kimi_helix` when transformers is already imported, and otherwise on the first
use of any name above; `kimi_helix.register_auto_classes()` does it explicitly.
"""

from __future__ import annotations

import importlib
import sys

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "engine",
    "SamplingParams": "engine",
    "plan_memory": "engine.planner",
    "CheckpointError": "modeling",
    "ConfigError": "modeling",
    "KimiK3Cache": "modeling",
    "KimiK3Config": "modeling",
    "KimiK3ForCausalLM": "modeling",
    "KimiK3Model": "modeling",
    "KimiK3PreTrainedModel": "modeling",
}
__all__ = [*_EXPORTS, "register_auto_classes"]


def register_auto_classes() -> None:
    """Route `kimi_k3` and `kimi_linear` checkpoints loaded through the Auto classes to kimi_helix (idempotent)."""
    from .modeling.registration import register_auto_classes as register

    register()


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        register_auto_classes()
        globals()[name] = value
        return value
    try:  # a submodule used as an attribute (`kimi_helix.presets.get_preset`) without importing it first
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if "transformers" in sys.modules:
    register_auto_classes()
