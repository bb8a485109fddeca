"""The DSpark drafter (DeepSpec's standalone linear-chain drafter): config, model and target-feature capture."""

from .config import DSparkConfig

__all__ = ["DSparkConfig"]
