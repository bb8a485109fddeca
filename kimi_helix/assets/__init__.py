"""Files shipped inside the package: the trained demo model (`demo/`), its tokenizer and corpus manifest, and the
DSpark drafter distilled for it (`demo/drafter/`)."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_WEIGHTS = "model.safetensors"
DEMO_DRAFTER_DIR = DEMO_DIR / "drafter"


def demo_model_dir() -> Path:
    """The folder of the shipped demo model (config.json, model.safetensors, tokenizer files).

    Load it like any checkpoint: `KimiK3ForCausalLM.from_pretrained(demo_model_dir())` and
    `AutoTokenizer.from_pretrained(demo_model_dir(), trust_remote_code=False)`. Raises `FileNotFoundError` when the
    weights are missing (a source checkout from before the trained model was committed)."""
    if not (DEMO_DIR / DEMO_WEIGHTS).is_file():
        raise FileNotFoundError(f"the demo model's weights {DEMO_DIR / DEMO_WEIGHTS} are missing")
    return DEMO_DIR


def demo_drafter_dir() -> Path:
    """The folder of the DSpark drafter shipped for the demo model (config.json, model.safetensors;
    `scripts/train_drafter.py`), the one speculative decoding uses on the demo model when no drafter is named.

    Raises `FileNotFoundError` when it is missing (a checkout from before the drafter was committed)."""
    if not (DEMO_DRAFTER_DIR / DEMO_WEIGHTS).is_file():
        raise FileNotFoundError(f"the demo model's drafter {DEMO_DRAFTER_DIR / DEMO_WEIGHTS} is missing")
    return DEMO_DRAFTER_DIR


def default_drafter_dir(model_dir) -> Path | None:
    """The drafter to use for `model_dir` when none is named: the shipped demo drafter for the demo model's own
    folder (if the drafter exists), else None."""
    if model_dir is None or Path(model_dir).resolve() != DEMO_DIR:
        return None
    return DEMO_DRAFTER_DIR if (DEMO_DRAFTER_DIR / DEMO_WEIGHTS).is_file() else None


__all__ = ["DEMO_DIR", "DEMO_DRAFTER_DIR", "DEMO_WEIGHTS", "default_drafter_dir", "demo_drafter_dir", "demo_model_dir"]
