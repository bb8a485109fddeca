"""The engine: same tokens as the HF path, independent of batch neighbours, waits for pages, fp8 latents."""

import pytest
import torch

from kimi_helix import KimiK3Cache, KimiK3Config, KimiK3ForCausalLM
from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.modeling.batch import ForwardBatch
from kimi_helix.modeling.paged_mla import gather_context

from ..modeling.conftest import k3_kwargs, randomize_router_bias, rel_err, tiny_kwargs


def make_model(kwargs=None, seed=0):
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(KimiK3Config(**(kwargs or tiny_kwargs()))).eval()
    randomize_router_bias(model, seed)
    return model


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kwargs", [tiny_kwargs(), k3_kwargs()], ids=["kimi-linear", "k3-style"])
def test_greedy_batch_equals_per_prompt_hf_generate(kwargs):
    model = make_model(kwargs)
    ps = prompts([5, 70, 1, 33, 129])
    outs = LLM(model, page_size=16, max_num_batched_tokens=64).generate(
        ps, SamplingParams(max_tokens=12, temperature=0)
    )
    for p, out in zip(ps, outs):
        expected = hf_greedy(model, p, 12)  # stops after EOS, as the engine does without ignore_eos
        assert out.token_ids == expected
        assert out.finish_reason == ("stop" if expected[-1] == model.config.eos_token_id else "length")
        assert out.num_prompt_tokens == len(p) and out.num_generated_tokens == len(expected)


def test_output_does_not_depend_on_batch_neighbours():
    model = make_model()
    target = prompts([40])[0]
    alone = LLM(model).generate([target], GREEDY)[0].token_ids
    crowded = LLM(model, max_num_batched_tokens=32).generate(prompts([3, 90, 17], seed=1) + [target], GREEDY)
    assert crowded[-1].token_ids == alone


def test_requests_wait_for_pages_then_complete_unchanged():
    model = make_model()
    ps = prompts([30, 45, 20, 60], seed=2)
    roomy = LLM(model, page_size=8).generate(ps, GREEDY)
    # Each request reserves ceil((len + 11) / 8) <= 9 pages; 10 pages hold one request at a time.
    tight = LLM(model, page_size=8, num_pages=10)
    assert [o.token_ids for o in tight.generate(ps, GREEDY)] == [o.token_ids for o in roomy]
    assert max(m.running for m in tight.metrics) == 1
    assert max(m.waiting for m in tight.metrics) >= 1
    assert all(m.pages_in_use <= 10 for m in tight.metrics)


def test_request_that_can_never_fit_names_the_limit():
    llm = LLM(make_model(), page_size=8, num_pages=4, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="needs 7 cache pages of 8 tokens but the cache has only 4 pages"):
        llm.generate([[5] * 3, [5] * 40], SamplingParams(max_tokens=10))
    # Nothing of a rejected call stays queued: the engine still serves the next call.
    assert llm.generate([[5] * 3], SamplingParams(max_tokens=2))[0].num_generated_tokens == 2


def test_seeded_sampling_is_reproducible_and_batch_independent():
    model = make_model()
    ps = prompts([9, 21], seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    a = LLM(model).generate(ps, params)
    b = LLM(model).generate(ps[::-1] + prompts([4], seed=9), params)
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids


def test_stop_token_ids_finish_with_stop():
    model = make_model()
    p = prompts([10], seed=4)[0]
    first = LLM(model).generate([p], GREEDY)[0].token_ids
    out = LLM(model).generate(
        [p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first[3]], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == first[: first.index(first[3]) + 1]


def test_fp8_latent_cache_logit_error_is_small():
    """Report the fp8 e4m3 KV error against the fp32 cache: relative logit error of one decode step."""
    model = make_model()
    ids = torch.tensor(prompts([50], seed=5))
    with torch.no_grad():
        reference = model(ids).logits[0, -1]
        for kv in ("auto", "fp8_e4m3"):
            llm = LLM(model, kv_cache_dtype=kv, page_size=16)
            llm.cache.ledger.admit(0, 50)
            view = llm.cache.view([0])
            prefill = ForwardBatch.build([49], [0], "cpu")
            model.model.forward_packed(model.model.embed_tokens(ids[0, :49]), prefill, view)
            view.commit(prefill)
            step = ForwardBatch.build([1], [49], "cpu")
            hidden = model.model.forward_packed(model.model.embed_tokens(ids[0, 49:]), step, view)
            err = rel_err(model.lm_head(hidden[-1]), reference)
            print(f"kv_cache_dtype={kv}: relative logit error {err:.2e}")
            assert err < (1e-5 if kv == "auto" else 5e-2)
            if kv == "fp8_e4m3":
                assert err > 1e-6  # the latents really went through fp8


def test_hf_cache_and_paged_cache_hold_the_same_latents():
    model = make_model()
    ids = torch.tensor(prompts([20], seed=6))
    hf = KimiK3Cache(model.config, 1)
    with torch.no_grad():
        model(ids, cache=hf, use_cache=True)
    llm = LLM(model, page_size=8)
    llm.cache.ledger.admit(0, 20)
    batch = ForwardBatch.build([20], [0], "cpu")
    with torch.no_grad():
        model.model.forward_packed(model.model.embed_tokens(ids[0]), batch, llm.cache.view([0]))
    layer = next(iter(hf.latents))
    kv = llm.cache.view([0]).mla_latents(layer, batch, like=None)
    paged = gather_context(kv, kv.block_table, [20], torch.float32)
    assert torch.equal(paged, hf.latents[layer][0])
