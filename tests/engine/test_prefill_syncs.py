"""A prefill step's forward reads nothing back from the device (a read is a device sync, and a prefill would pay
it in every layer): the kernels take the host's offsets (`ForwardBatch.host_cu_seqlens` / `host_cu_totals`) and
the MLA context's slots come from the host's page lists. Checked with every op on its Triton kernel (the CPU
interpreter here): on the CPU a read of a device value shows up as `.item()` / `.tolist()` / `nonzero` / a
`repeat_interleave` without `output_size`."""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.modeling.batch import ForwardBatch, Phase

from ..modeling.conftest import k3_kwargs, randomize_router_bias

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
aten = torch.ops.aten


class Reads(TorchDispatchMode):
    """Records the ops that read a device value on the host, and `.tolist()` of tensors not in `host`."""

    def __init__(self):
        super().__init__()
        self.reads, self.host, self.active = [], set(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and (
            func in (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default)
            or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None)
        ):
            self.reads.append(str(func))
        return func(*args, **kwargs)


def test_prefill_forward_reads_nothing_back(monkeypatch):
    kwargs = {**k3_kwargs(), "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16}
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(model)
    llm = LLM(model, page_size=16, max_model_len=64, attention_backend="triton", kernel_backend="triton")
    spy = Reads()
    sums, tolist, forward = ForwardBatch._prefix_sums, torch.Tensor.tolist, llm.runner.forward
    host = {}

    def prefix_sums(self, *args):  # the host's own offsets: reading them is no sync
        t = sums(self, *args)
        host[id(t)] = t
        return t

    def spied_tolist(t):
        if spy.active and host.get(id(t)) is not t:
            spy.reads.append("tolist")
        return tolist(t)

    def spied_forward(inputs):
        spy.active = Phase.PREFILL in inputs.batch.phases
        try:
            return forward(inputs)
        finally:
            spy.active = False

    monkeypatch.setattr(ForwardBatch, "_prefix_sums", prefix_sums)
    monkeypatch.setattr(torch.Tensor, "tolist", spied_tolist)
    monkeypatch.setattr(llm.runner, "forward", spied_forward)
    prompts = [[5, 17, 99, 3, 42, 8, 61, 7, 9], list(range(3, 23))]
    with spy:
        out = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 2 for o in out)
    assert spy.reads == []
