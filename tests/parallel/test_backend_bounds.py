"""A cp > 1 verify needs per-token KV bounds: the switch never picks a backend that lacks them (a causal-slope
kernel, `kv_len - (q_len - 1 - r)`, is wrong on ranks that own none or part of a group), and Helix always asks."""

import pytest
import torch

from kimi_helix.kernels import backends
from kimi_helix.kernels.backends import AttentionRequest, BackendUnavailableError, KernelCaps, select
from kimi_helix.parallel.ownership import Ownership


@pytest.fixture
def with_slope_backend(monkeypatch):
    """The real registry plus a fastest-first verify backend that only knows the causal slope."""
    real = backends.registry()
    slope = KernelCaps(frozenset({"cpu", "cuda"}), frozenset({"fp32"}), frozenset({"fp32"}), kv_bounds=False)
    monkeypatch.setattr(backends, "registry", lambda: {**real, "slope": {"mla_decode": slope, "mla_verify": slope}})
    monkeypatch.setattr(backends, "PRIORITY", {d: ("slope", *o) for d, o in backends.PRIORITY.items()})
    select.cache_clear()
    yield
    select.cache_clear()


def _request(**kw):
    base = dict(phase="verify", num_heads=4, head_dim=40, v_head_dim=32, q_dtype="fp32", kv_dtype="fp32", device="cpu")
    return AttentionRequest(**{**base, **kw})


def test_switch_never_picks_a_backend_without_bounds(with_slope_backend):
    assert select(_request()) == "slope"  # without bounds the slope kernel would be chosen
    for phase in ("decode", "verify"):
        chosen = select(_request(phase=phase, need_kv_bounds=True, need_lse=True))
        assert chosen != "slope" and backends.registry()[chosen][f"mla_{phase}"].kv_bounds
    with pytest.raises(BackendUnavailableError, match="per-token KV bounds"):
        select(_request(need_kv_bounds=True), "slope")


def test_every_backend_serving_bounds_declares_them():
    for name, table in backends.registry().items():
        for phase in ("decode", "verify"):
            caps = table.get(f"mla_{phase}")
            if caps is not None and not caps.reasons(_request(phase=phase, need_kv_bounds=True)):
                assert caps.kv_bounds, (name, phase)


def test_helix_attention_always_passes_bounds(monkeypatch):
    """The Helix path hands the kernel `local_len(pos + 1)` per token and its local pages, in every phase."""
    from kimi_helix.modeling.batch import ForwardBatch, Phase
    from kimi_helix.modeling.paged_mla import PagedLatents
    from kimi_helix.parallel import helix

    seen = {}

    def fake_decode(q, pages, block_table, lens, *args, kv_bounds=None, need_lse=False, phase="decode", **kw):
        seen.update(bounds=kv_bounds, need_lse=need_lse, phase=phase, table=block_table, lens=lens)
        raise StopIteration

    monkeypatch.setattr(helix, "mla_decode", fake_decode)
    own = Ownership(4, 2, 0)
    attend = helix.HelixAttention(own, comm=None)
    module = type("M", (), dict(layer_idx=0, nope=8, v_dim=8, kv_lora_rank=32, scale=1.0))()
    module.kv_b_proj = torch.nn.Linear(32, 4 * 16, bias=False)
    # positions 6..9 straddle global pages 1 (rank 1) and 2 (rank 0); this rank holds pages 0 and 2 as 5 and 7
    batch = ForwardBatch.build([4], [6], "cpu", [Phase.VERIFY])
    table = torch.tensor([[5, -1, 7]], dtype=torch.int32)
    slots = torch.tensor([-2, -1, 30, 31])  # what the runner computes from that table; -1 pages give junk
    pages = torch.zeros(8, 4, 40)
    kv = PagedLatents(pages, None, table, torch.tensor([10], dtype=torch.int32), slots)
    latent = torch.arange(4.0)[:, None].expand(4, 40)
    with pytest.raises(StopIteration):
        attend(module, torch.zeros(4, 4, 16), latent, batch, kv)
    assert seen["phase"] == "verify" and seen["need_lse"]
    assert seen["bounds"].tolist() == own.kv_bounds(torch.arange(6, 10)).tolist() == [4, 4, 5, 6]
    assert seen["table"].tolist() == [[5, 7]] and seen["lens"].tolist() == [6]
    flat = pages.view(-1, 40)
    assert flat[30, 0] == 2 and flat[31, 0] == 3  # only the owned tokens were written, in their slots
    assert flat[:30].abs().sum() == 0 and flat[32:].abs().sum() == 0
