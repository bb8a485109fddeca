"""Helpers shared by the conv kernel tests (imported with `from .conftest import ...`)."""

from __future__ import annotations

import functools

import torch

from ..conftest import cu_seqlens

D, W = 40, 4  # D spans two masked channel blocks under the interpreter


cu = functools.partial(cu_seqlens, dtype=torch.int64)
