"""Launch layouts built on the host and uploaded once per distinct input, cached for the process: the chunked
KDA's chunk list and the MLA prefill's block map. Every layer of a pass asks for the same one.

A CUDA graph records the device addresses its kernels read, so a captured step must keep its layouts alive after
the cache has evicted them: `retained()` collects every layout handed out inside it, and the graph holds the list
(`engine.cuda_graph`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["layout_cache", "retained"]

_scopes: list[list] = []  # the open `retained()` scopes, innermost last


def layout_cache(maxsize: int) -> Callable[[Callable], Callable]:
    """Decorator: memoise a layout builder on its (hashable) arguments, least recently used out beyond `maxsize`;
    every value it returns is also appended to the open `retained()` scopes."""
    if maxsize < 1:
        raise ValueError(f"maxsize must be >= 1, got {maxsize}")

    def wrap(build: Callable) -> Callable:
        entries: OrderedDict = OrderedDict()

        @functools.wraps(build)
        def cached(*key):
            value = entries.pop(key, None)
            if value is None:
                value = build(*key)
                if len(entries) >= maxsize:
                    entries.popitem(last=False)
            entries[key] = value
            for kept in _scopes:
                kept.append(value)
            return value

        return cached

    return wrap


@contextmanager
def retained() -> Iterator[list]:
    """Within the block, every layout a `layout_cache` hands out is appended to the yielded list, which keeps it
    alive (and its device address valid) for as long as the caller holds the list."""
    kept: list = []
    _scopes.append(kept)
    try:
        yield kept
    finally:
        _scopes.remove(kept)
