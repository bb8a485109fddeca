"""Helpers shared by the kda kernel tests (imported with `from .conftest import ...`)."""

from __future__ import annotations

import functools

import pytest

from ..conftest import make_kda_inputs

H, K, V = 2, 32, 16  # K != V so a transposed state cannot pass; K spans two 16-wide slices of the intra kernel


@pytest.fixture(
    params=[(True, False), (True, True), (False, True), (False, False)], ids=["wide", "halves", "halves-only", "blocks"]
)
def intra_path(request, monkeypatch):
    """Every intra path: the chunk-wide kernel first (falling back per chunk to the block kernel), with or without
    its per-half relaunch in between, the per-half pass alone before the block kernel, or the block kernel for every
    chunk (["wide"], ["halves"] of chunk.INTRA and, for the bounded gate, chunk.INTRA_BOUNDED)."""
    from kimi_helix.kernels.kda import chunk

    for table in (chunk.INTRA, chunk.INTRA_BOUNDED):
        monkeypatch.setitem(table, "wide", request.param[0])
        monkeypatch.setitem(table, "halves", request.param[1])


H_R, K_R, V_R = 2, 16, 40  # K_R != V_R, and V_R spans two masked V-blocks (the recurrent kernel's tests)


make_recurrent_inputs = functools.partial(
    make_kda_inputs, h=H_R, k=K_R, v=V_R
)  # B, T, seed, dtype; h, k, v overridable
