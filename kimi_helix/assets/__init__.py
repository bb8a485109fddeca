"""Files shipped inside the package: the trained demo model (`demo/`), its tokenizer and corpus manifest."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_WEIGHTS = "model.safetensors"


def demo_model_dir() -> Path:
    """The folder of the shipped demo model (config.json, model.safetensors, tokenizer files).

    Load it like any checkpoint: `KimiK3ForCausalLM.from_pretrained(demo_model_dir())` and
    `AutoTokenizer.from_pretrained(demo_model_dir(), trust_remote_code=False)`. Raises `FileNotFoundError` when the
    weights are missing (a source checkout from before the trained model was committed)."""
    if not (DEMO_DIR / DEMO_WEIGHTS).is_file():
        raise FileNotFoundError(f"the demo model's weights {DEMO_DIR / DEMO_WEIGHTS} are missing")
    return DEMO_DIR


__all__ = ["DEMO_DIR", "DEMO_WEIGHTS", "demo_model_dir"]
