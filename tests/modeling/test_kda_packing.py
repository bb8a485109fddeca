"""KDA's packed projections: one GEMM over a weight whose row blocks the q/k/v/f_a/g_a/b weights are views of, and
one over a block-diagonal weight whose diagonal blocks the low-rank gates' f_b and g_b weights are views of.

The packing runs on CUDA only (`packing.PACK_DEVICES`); these CPU tests add the CPU to it, the GPU test saves a packed
model, which is what the CUDA restriction is for.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.modeling import packing
from kimi_helix.modeling.kda import KimiDeltaAttention

from .conftest import k3_kwargs, randomize_router_bias, tiny_kwargs


def _model(kwargs, dtype=torch.float32):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval().to(dtype)
    randomize_router_bias(model)
    return model


def _kda_layers(model):
    return [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _separate_logits(model, ids, monkeypatch):
    """Logits of `model` without packing (PACK_DEVICES emptied for the call)."""
    with monkeypatch.context() as m:
        m.setattr(packing, "PACK_DEVICES", ())
        return _logits(model, ids)


def _gate_linears(layer: KimiDeltaAttention) -> list:
    return [] if layer.use_full_rank_gate else [layer.f_b_proj, layer.g_b_proj]


def _is_packed(layer: KimiDeltaAttention) -> bool:
    rows, diagonal = layer._x_pack.packed, layer._gate_pack.packed
    if rows is None or not packing.blocks_of(rows, [w.weight for w in layer._x_linears()]):
        return False
    if layer.use_full_rank_gate:
        return diagonal is None
    return diagonal is not None and packing.blocks_of(diagonal, [w.weight for w in _gate_linears(layer)], True)


@pytest.fixture
def pack_on_cpu(monkeypatch):
    monkeypatch.setattr(packing, "PACK_DEVICES", ("cuda", "cpu"))


IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 61]])


@pytest.mark.usefixtures("pack_on_cpu")
@pytest.mark.parametrize("kwargs", [tiny_kwargs(), k3_kwargs()], ids=["low_rank_gate", "full_rank_gate"])
def test_packed_equals_separate_and_keeps_names(kwargs, monkeypatch):
    packed, plain = _model(kwargs), _model(kwargs)
    names = {k: v.clone() for k, v in packed.state_dict().items()}
    n_params = sum(p.numel() for p in packed.parameters())
    expected = _separate_logits(plain, IDS, monkeypatch)
    torch.testing.assert_close(_logits(packed, IDS), expected, rtol=1e-5, atol=1e-5)
    assert all(_is_packed(layer) for layer in _kda_layers(packed))
    after = packed.state_dict()
    assert after.keys() == names.keys() and all(torch.equal(after[k], v) for k, v in names.items())
    assert sum(p.numel() for p in packed.parameters()) == n_params


@pytest.mark.usefixtures("pack_on_cpu")
def test_in_place_edits_reach_the_packed_weight(monkeypatch):
    packed = _model(tiny_kwargs())
    _logits(packed, IDS)
    layer = _kda_layers(packed)[0]
    with torch.no_grad():
        layer.k_proj.weight.mul_(-2.0)  # as load_state_dict or an optimiser step would write it
        layer.b_proj.weight.add_(0.5)
        layer.g_b_proj.weight.mul_(3.0)
    assert _is_packed(layer)
    k = layer.head_dim  # the block-diagonal weight's other blocks stay zero
    p = layer.num_heads * k
    off = torch.cat([layer._gate_pack.packed[:p, k:].flatten(), layer._gate_pack.packed[p:, :k].flatten()])
    assert torch.count_nonzero(off) == 0
    expected = _separate_logits(copy.deepcopy(packed), IDS, monkeypatch)
    torch.testing.assert_close(_logits(packed, IDS), expected, rtol=1e-5, atol=1e-5)


def _replace_weights(model):
    """New Parameters with the same values, as `parallel.tp.shard_model`, a meta materialisation or an offloading
    hook put in."""
    for layer in _kda_layers(model):
        for lin in layer._x_linears() + _gate_linears(layer):
            lin.weight = torch.nn.Parameter(lin.weight.detach().clone())


@pytest.mark.usefixtures("pack_on_cpu")
def test_replaced_weights_repack_once_then_run_separately():
    model = _model(tiny_kwargs())
    first = _logits(model, IDS)
    layer = _kda_layers(model)[0]
    old = layer._x_pack.packed, layer._gate_pack.packed
    _replace_weights(model)
    torch.testing.assert_close(_logits(model, IDS), first, rtol=1e-6, atol=1e-6)
    assert _is_packed(layer) and layer._x_pack.packed is not old[0] and layer._gate_pack.packed is not old[1]
    _replace_weights(model)  # replaced again: from now on the separate GEMMs run and nothing stays packed
    torch.testing.assert_close(_logits(model, IDS), first, rtol=1e-6, atol=1e-6)
    x = torch.zeros(1, 64)
    assert layer._x_pack.packed is None and layer._x_pack.weight(layer._x_linears(), x) is None
    assert layer._gate_pack.weight(_gate_linears(layer), x) is None and layer._gate_pack.packed is None


@pytest.mark.usefixtures("pack_on_cpu")
def test_autograd_runs_the_separate_weights():
    model = _model(tiny_kwargs()).train()
    model(IDS).logits.sum().backward()
    layer = _kda_layers(model)[0]
    assert layer._x_pack.packed is None and layer._gate_pack.packed is None
    assert all(lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0 for lin in layer._x_linears())


def test_no_packing_off_cuda_by_default():
    model = _model(tiny_kwargs())
    _logits(model, IDS)
    assert all(layer._x_pack.packed is None and layer._gate_pack.packed is None for layer in _kda_layers(model))


@pytest.mark.gpu
def test_gpu_packed_model_saves_and_loads(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model(tiny_kwargs(), torch.bfloat16).cuda()
    ids = IDS.cuda()
    logits = _logits(model, ids)
    assert all(_is_packed(layer) for layer in _kda_layers(model))
    model.save_pretrained(tmp_path)
    loaded = KimiK3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    saved = loaded.state_dict()
    for name, p in model.state_dict().items():  # the gate and routing parameters load in fp32
        assert torch.equal(saved[name].cuda().to(p.dtype), p), name
    torch.testing.assert_close(_logits(loaded, ids), logits, rtol=2e-2, atol=2e-2)  # bf16; MoE sums may reorder


@pytest.mark.usefixtures("pack_on_cpu")
@pytest.mark.parametrize("name", ["v_proj", "g_b_proj"])
def test_hooked_projection_is_not_packed(name, monkeypatch):
    """A forward hook on one projection (an adapter, a quantiser, accelerate) must run: its pack stays separate."""
    model, plain = _model(tiny_kwargs()), _model(tiny_kwargs())
    for m in (model, plain):
        getattr(_kda_layers(m)[0], name).register_forward_hook(lambda mod, args, out: out * 0.5)
    expected = _separate_logits(plain, IDS, monkeypatch)
    torch.testing.assert_close(_logits(model, IDS), expected, rtol=1e-5, atol=1e-5)
    first, rest = _kda_layers(model)[0], _kda_layers(model)[1:]
    assert all(_is_packed(layer) for layer in rest)
    assert first._gate_pack.packed is None
    assert (first._x_pack.packed is None) == (name == "v_proj")
