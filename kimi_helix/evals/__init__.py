"""lm-evaluation-harness runs of kimi_helix models: the `kimi_helix` lm-eval model, GPQA from a local file and the
demo model's held-out tasks (`tasks/`). Needs the `eval` extra (`pip install kimi-helix[eval]`).

    python -m kimi_helix.evals --model kimi_helix --model_args pretrained=DIR --tasks kimi_helix_next_line
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
INSTALL_HINT = "lm-eval is not installed: pip install kimi-helix[eval]"

__all__ = ["INSTALL_HINT", "TASKS_DIR"]
