"""DRAFT ATTENTION: the kernel in every dtype, bf16 included, on the GPU (`pytest -m gpu`), at the DSpark drafter's
shape (H = 16, D = 128, G = 7) and the head dims at the kernel's bounds, over a cache of a few hundred rows."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.draft_attention import draft_attention_ref
from kimi_helix.kernels.draft_attention.triton import draft_attention_triton

from ..conftest import TOL, assert_rel_close, rnd

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_empty")]


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("g, h, d", [(7, 16, 128), (16, 4, 256), (3, 8, 16)], ids=["dspark", "D256", "D16"])
@pytest.mark.parametrize("n", [1, 16], ids=["N1", "N16"])
def test_gpu_matches_reference(dtype, n, g, h, d):
    s, c = 2 * n + 1, 300
    gen = torch.Generator().manual_seed(n + g)
    slots = torch.randperm(s, generator=gen)[:n].cuda()
    lengths = torch.randint(0, c + 1, (n,), generator=gen).cuda()
    lengths[0] = c
    q, k_blk, v_blk = rnd(n, g, 3, h, d, seed=g, dtype=dtype).unbind(2)
    kv = rnd(s, c, 2, h, d, seed=d, dtype=dtype)
    ref = draft_attention_ref(q, k_blk, v_blk, *kv.unbind(2), slots, lengths)
    # every row no request sees is NaN: the kernel must never read one
    poisoned = torch.full_like(kv, float("nan"))
    for slot, length in zip(slots.tolist(), lengths.tolist(), strict=True):
        poisoned[slot, :length] = kv[slot, :length]
    out = draft_attention_triton(q, k_blk, v_blk, *poisoned.unbind(2), slots, lengths)
    for i in range(n):
        assert_rel_close(f"out[{i}]", out[i], ref[i], TOL[dtype])
