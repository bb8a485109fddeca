"""MLA: the expanded and weight-absorbed forms compute the same attention; the cache holds only the latent."""

import pytest
import torch

from kimi_helix import KimiK3Cache, KimiK3Config, KimiK3ForCausalLM
from kimi_helix.modeling.mla import mla_absorbed, mla_expanded, softmax_attention

from .conftest import k3_kwargs, rel_err, tiny_kwargs


@pytest.mark.parametrize("tq,tk", [(1, 1), (1, 37), (5, 5), (4, 70), (64, 100)])
@pytest.mark.parametrize("heads", [1, 3, 96])
def test_absorbed_equals_expanded(tq, tk, heads):
    g = torch.Generator().manual_seed(tq * 1000 + tk + heads)
    nope, rope, v_dim, r = 16, 8, 12, 20
    q = torch.randn(tq, heads, nope + rope, generator=g)
    latent = torch.randn(tk, r + rope, generator=g)
    w = torch.randn(heads * (nope + v_dim), r, generator=g) / r**0.5
    scale = (nope + rope) ** -0.5
    expanded = mla_expanded(q, latent, w, nope, v_dim, scale, tk - tq)
    absorbed = mla_absorbed(q, latent, w, nope, v_dim, scale, tk - tq)
    assert expanded.shape == (tq, heads, v_dim)
    assert rel_err(absorbed, expanded) < 1e-5


def test_softmax_attention_scale_mask_and_empty_rows():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 4, generator=g)
    out, lse = softmax_attention(q, k, v, scale=0.3, q_offset=2)
    for i in range(3):
        s = torch.einsum("hd,khd->hk", q[i], k[: 3 + i]) * 0.3
        assert torch.allclose(out[i], torch.einsum("hk,khd->hd", s.softmax(-1), v[: 3 + i]), atol=1e-6)
        assert torch.allclose(lse[i], s.logsumexp(-1), atol=1e-6)
    # A query that sees no key (offset -1) gives exact zeros and lse = -inf, never NaN.
    out, lse = softmax_attention(q[:1], k, v, scale=0.3, q_offset=-1)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()


@pytest.mark.parametrize("kwargs", [tiny_kwargs(), k3_kwargs()], ids=["kimi-linear", "k3-style"])
def test_cache_holds_only_the_compressed_latent(kwargs):
    config = KimiK3Config(**kwargs)
    model = KimiK3ForCausalLM(config).eval()
    cache = KimiK3Cache(config, batch_size=2)
    with torch.no_grad():
        model(torch.randint(3, 128, (2, 9)), cache=cache, use_cache=True)
    mla_layers = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    assert sorted(cache.latents) == mla_layers
    for rows in cache.latents.values():
        assert [tuple(r.shape) for r in rows] == [(9, config.kv_lora_rank + config.qk_rope_head_dim)] * 2


def test_rope_makes_mla_position_dependent_and_nope_does_not():
    """With RoPE a token's logits depend on where the sequence starts; NoPE MLA sees only content."""
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    for nope in (True, False):
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs(mla_use_nope=nope))).eval()
        with torch.no_grad():
            full = model(ids).logits[0, -1]
            # Same tokens, but the first 4 are consumed first: positions are unchanged, so logits must agree.
            cache = KimiK3Cache(model.config, 1)
            model(ids[:, :4], cache=cache, use_cache=True)
            split = model(ids[:, 4:], cache=cache, use_cache=True).logits[0, -1]
        assert rel_err(split, full) < 1e-5
