"""Projections that read the same input run as one GEMM over a packed weight (`packing.WeightPack`): MLA's q (or
q_a), kv_a and output gate, a SwiGLU's gate and up, and the DSpark drafter's q, k and v (its context keys and
values: one GEMM over the packed k and v rows). Packing runs on CUDA only; these CPU tests add the CPU to it."""

from __future__ import annotations

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.modeling import packing
from kimi_helix.modeling.layers import SwiGLU
from kimi_helix.modeling.mla import MLAttention

from ..speculative.conftest import tiny_drafter_config
from .conftest import k3_kwargs, randomize_router_bias, tiny_kwargs

IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 61]])


def _model(kwargs):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(model)
    return model


@pytest.mark.parametrize("kwargs", [tiny_kwargs(), k3_kwargs()], ids=["plain_mla", "k3_mla"])
def test_mla_and_swiglu_packed_equal_separate(kwargs, monkeypatch):
    model = _model(kwargs)
    with torch.no_grad():
        expected = model(IDS).logits
        monkeypatch.setattr(packing, "PACK_DEVICES", ("cuda", "cpu"))
        names = {k: v.clone() for k, v in model.state_dict().items()}
        got = model(IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    mla = [m for m in model.modules() if isinstance(m, MLAttention)]
    mlps = [m for m in model.modules() if isinstance(m, SwiGLU) and m._pack.packed is not None]
    assert mla and all(packing.blocks_of(m._x_pack.packed, [lin.weight for lin in m._x_linears()]) for m in mla)
    assert all(len(m._x_linears()) == 2 + m.output_gate for m in mla)
    assert mlps and all(packing.blocks_of(m._pack.packed, [m.gate_proj.weight, m.up_proj.weight]) for m in mlps)
    after = model.state_dict()
    assert after.keys() == names.keys() and all(torch.equal(after[k], v) for k, v in names.items())


def test_drafter_packed_equals_separate(monkeypatch):
    from kimi_helix.presets import get_preset
    from kimi_helix.speculative.dspark import DSparkDrafter, SlotContext

    torch.manual_seed(0)
    target = KimiK3ForCausalLM(get_preset("tiny")).eval()
    torch.manual_seed(1)
    drafter = DSparkDrafter(tiny_drafter_config()).eval()
    drafter.bind_target(target)
    p = 9
    feats = torch.randn(1, p, drafter.fc.weight.shape[1])

    def run():
        ctx = drafter.context_keys_values(feats, torch.arange(p)[None])
        context = SlotContext(ctx, torch.tensor([0]), torch.tensor([p]))
        return ctx, drafter.draft(torch.tensor([7]), torch.tensor([p]), context, 4, [0.0], [None])

    ctx, draft = run()
    monkeypatch.setattr(packing, "PACK_DEVICES", ("cuda", "cpu"))
    packed_ctx, packed_draft = run()
    assert all(layer.self_attn._qkv_pack.packed is not None for layer in drafter.layers)
    for (k, v), (pk, pv) in zip(ctx, packed_ctx):
        torch.testing.assert_close(pk, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pv, v, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed_draft.tokens, draft.tokens)
    torch.testing.assert_close(packed_draft.confidence, draft.confidence)
