"""The engine with every op forced to its Triton kernel (the CPU interpreter here, the GPU path on a GPU) gives the
same greedy tokens as the torch references: the kernels are wired into the model, not only tested alone."""

import logging

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.kernels.backends import OPS, select

from ..modeling.conftest import k3_kwargs, randomize_router_bias


@pytest.fixture
def fresh_selection():
    select.cache_clear()  # selections are cached (and logged) once per distinct case
    yield
    select.cache_clear()


def test_all_triton_engine_equals_torch_engine(fresh_selection, caplog):
    # Triton tiles need power-of-two widths: latent 32 + 16, expanded heads 16 + 16 / 16, KDA heads of 16.
    kwargs = {**k3_kwargs(), "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16}
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 19)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    # 128 keys a sequence at most: decode still splits them (over 4 programs), where the default 8192 would launch
    # 128 splits of mostly empty pages through the interpreter.
    engine = dict(page_size=16, max_model_len=128)
    with caplog.at_level(logging.INFO, logger="kimi_helix.kernels.backends"):
        fast = LLM(model, **engine, attention_backend="triton", kernel_backend="triton").generate(prompts, params)
    chosen = " ".join(caplog.messages)
    speculative = ("markov_chain_greedy", "draft_attention", "norm_rotary", "norm_rotary_into_cache")
    speculative += ("accept_and_stage", "restore_verified_states")
    target_ops = [op for op in OPS if op not in speculative]  # the drafter's and the asynchronous rounds' ops
    for op in target_ops:  # the projections' `linear` is always chosen automatically (`layers.Linear`)
        forced = "triton" if op != "linear" else "torch"
        assert f"kernel backend {forced} for OpRequest(op='{op}'" in chosen, op
    for phase in ("prefill", "decode"):
        assert f"attention backend triton for AttentionRequest(phase='{phase}'" in chosen, phase
    reference = LLM(model, **engine, attention_backend="torch", kernel_backend="torch").generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in reference]
