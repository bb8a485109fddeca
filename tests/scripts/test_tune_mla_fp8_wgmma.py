"""scripts/tune_mla_fp8_wgmma.py: each variant it times is the one the launcher then chooses."""

from __future__ import annotations

import torch

from kimi_helix.kernels.mla import decode, decode_schedule

from .conftest import load_script


def _chosen():
    """The fp8 schedule the launcher picks for b = 128, H = 16 decode, and the Gluon kernel's dequant side."""
    return decode_schedule.choose_tiles(16, 128, 128, torch.float16, 1, 512)[1], decode.FP8_WGMMA


def test_variants_reach_the_launcher_and_are_undone():
    tune = load_script("tune_mla_fp8_wgmma")
    committed = _chosen()
    saved = tune._snapshot()
    for variant in [("triton", 2), (1, 1, 232, 1, 0), ("triton", 8)]:
        tune._restore(saved)
        tune._apply(variant)
        sched, params = _chosen()
        if variant[0] == "triton":
            assert not sched.wgmma and sched.min_waves == variant[1]
        else:
            assert sched.wgmma and sched.min_waves == variant[3]
            assert params == decode.Fp8WgmmaParams(*variant[:3], *variant[4:])
    tune._restore(saved)
    assert _chosen() == committed
