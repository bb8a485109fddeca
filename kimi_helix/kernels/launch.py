"""Integer helpers for host code: the launchers' grids and blocks, and the engine's page counts.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from Python each costs about 3 us
(Triton 3.6 and 3.9, measured on the CPU), and a decode step makes a few dozen such calls across its launches. These
plain-int versions give the same results for a few tens of nanoseconds. Inside ``@triton.jit`` code keep Triton's.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0, as ``triton.cdiv``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
