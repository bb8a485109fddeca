"""Speculative decoding: the validator, the DSpark drafter, proposers, lossless verification and scheduling."""

from .validator import SpeculativeConfig, UnsupportedConfigError, validate_speculative_config

__all__ = ["SpeculativeConfig", "UnsupportedConfigError", "validate_speculative_config"]
