"""KDA's packed input projections: one GEMM over a weight whose row blocks the q/k/v/f_a/b/g_a weights are views of.

The packing runs on CUDA only (`kda.PACK_DEVICES`); these CPU tests add the CPU to it, the GPU test saves a packed
model, which is what the CUDA restriction is for.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.modeling import kda as kda_module
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
        m.setattr(kda_module, "PACK_DEVICES", ())
        return _logits(model, ids)


def _is_packed(layer: KimiDeltaAttention) -> bool:
    return layer._packed is not None and kda_module._row_blocks_of(
        layer._packed, [w.weight for w in layer._x_linears()]
    )


@pytest.fixture
def pack_on_cpu(monkeypatch):
    monkeypatch.setattr(kda_module, "PACK_DEVICES", ("cuda", "cpu"))


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
    assert _is_packed(layer)
    expected = _separate_logits(copy.deepcopy(packed), IDS, monkeypatch)
    torch.testing.assert_close(_logits(packed, IDS), expected, rtol=1e-5, atol=1e-5)


def _replace_weights(model):
    """New Parameters with the same values, as `parallel.tp.shard_model`, a meta materialisation or an offloading
    hook put in."""
    for layer in _kda_layers(model):
        for lin in layer._x_linears():
            lin.weight = torch.nn.Parameter(lin.weight.detach().clone())


@pytest.mark.usefixtures("pack_on_cpu")
def test_replaced_weights_repack_once_then_run_separately():
    model = _model(tiny_kwargs())
    first = _logits(model, IDS)
    layer = _kda_layers(model)[0]
    old = layer._packed
    _replace_weights(model)
    torch.testing.assert_close(_logits(model, IDS), first, rtol=1e-6, atol=1e-6)
    assert _is_packed(layer) and layer._packed is not old
    _replace_weights(model)  # replaced again: from now on the separate GEMMs run and nothing stays packed
    torch.testing.assert_close(_logits(model, IDS), first, rtol=1e-6, atol=1e-6)
    assert layer._packed is None and layer._packed_weight(torch.zeros(1, 64)) is None


@pytest.mark.usefixtures("pack_on_cpu")
def test_autograd_runs_the_separate_weights():
    model = _model(tiny_kwargs()).train()
    model(IDS).logits.sum().backward()
    layer = _kda_layers(model)[0]
    assert layer._packed is None
    assert all(lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0 for lin in layer._x_linears())


def test_no_packing_off_cuda_by_default():
    model = _model(tiny_kwargs())
    _logits(model, IDS)
    assert all(layer._packed is None for layer in _kda_layers(model))


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
def test_hooked_projection_is_not_packed(monkeypatch):
    """A forward hook on one projection (an adapter, a quantiser, accelerate) must run: that layer stays separate."""
    model, plain = _model(tiny_kwargs()), _model(tiny_kwargs())
    for m in (model, plain):
        _kda_layers(m)[0].v_proj.register_forward_hook(lambda mod, args, out: out * 0.5)
    expected = _separate_logits(plain, IDS, monkeypatch)
    torch.testing.assert_close(_logits(model, IDS), expected, rtol=1e-5, atol=1e-5)
    layers = _kda_layers(model)
    assert layers[0]._packed is None and all(_is_packed(layer) for layer in layers[1:])
