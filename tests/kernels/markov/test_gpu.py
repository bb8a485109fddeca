"""MARKOV: the greedy chain kernel in bf16 on the GPU (`pytest -m gpu`), at the demo drafter's vocab and at Kimi's."""

from __future__ import annotations

import pytest
import torch

from kimi_helix.kernels.markov import markov_chain_greedy_ref
from kimi_helix.kernels.markov.triton import markov_chain_greedy_triton

from ..conftest import TOL, assert_rel_close, rnd

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_empty")]


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("vocab", [8192, 163840], ids=["demo", "kimi"])
@pytest.mark.parametrize("n, k", [(1, 5), (1, 7), (16, 8)], ids=["N1K5", "N1K7", "N16K8"])
def test_gpu_bf16_matches_reference(vocab, n, k):
    r, d = 32, 2304
    base = rnd(n, k, vocab, seed=n + k) * 3
    anchors = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(k)).cuda()
    w1 = rnd(vocab, r, seed=1, dtype=torch.bfloat16)
    w2 = (rnd(vocab, r, seed=2) * 0.3).to(torch.bfloat16)
    hidden = rnd(n, k, d, seed=3, dtype=torch.bfloat16)
    conf_weight, conf_bias = (rnd(d + r, seed=4) * 0.02).to(torch.bfloat16), rnd(1, seed=5, dtype=torch.bfloat16)
    tokens, confidence = markov_chain_greedy_triton(base, anchors, w1, w2, hidden, conf_weight, conf_bias)
    ref_tokens, ref_conf = markov_chain_greedy_ref(base, anchors, w1, w2, hidden, conf_weight, conf_bias)
    assert torch.equal(tokens, ref_tokens)
    assert_rel_close("confidence", confidence, ref_conf, TOL[torch.bfloat16])
