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


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_request_metrics_stamp_the_steps_that_read_the_first_and_last_tokens(monkeypatch, overlap):
    """On a clock that counts engine steps, a request's first-token time is the step whose host read its first
    token (the prefill's own step, or the next one under asynchronous scheduling) and its finish time the step
    that read its last."""
    import time

    llm = LLM(make_model(), async_scheduling=overlap)
    clock = [0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    step = llm.step

    def counted_step():
        clock[0] += 1
        return step()

    monkeypatch.setattr(llm, "step", counted_step)
    out = llm.generate(prompts([10], seed=4), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    reads = [i + 1 for i, m in enumerate(llm.metrics) if m.generated_tokens]
    assert out.metrics.arrival_time == 0 and len(out.token_ids) == 5
    assert (out.metrics.first_token_time, out.metrics.finished_time) == (reads[0], reads[-1])
    assert reads[0] == (2 if overlap else 1)


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


# ---------------------------------------------------------------- bad input, tokenizers, failures, threads
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A `kimi-helix init` tiny checkpoint with the byte tokenizer."""
    from kimi_helix.cli import main

    folder = tmp_path_factory.mktemp("llm") / "tiny"
    assert main(["init", "--preset", "tiny", "--out", str(folder)]) == 0
    return folder


def test_string_prompts_use_the_tokenizer_of_the_model_folder(tiny_folder):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    by_path = LLM(str(tiny_folder)).generate(["Hello"], params)[0]
    assert by_path.prompt_token_ids == list(b"Hello")
    # A loaded model remembers its folder in `name_or_path` (transformers' convention); LLM loads the tokenizer there.
    model = KimiK3ForCausalLM.from_pretrained(tiny_folder)
    model.name_or_path = str(tiny_folder)
    loaded = LLM(model).generate(["Hello"], params)[0]
    assert loaded.token_ids == by_path.token_ids and loaded.text == by_path.text


def test_folder_tokenizer_with_code_is_refused(tmp_path, tiny_folder):
    import json
    import shutil

    from kimi_helix.tokenizer import TokenizerLoadError

    folder = tmp_path / "evil"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text("open(__file__ + '.PWNED', 'w').write('ran')\n")
    with pytest.raises(TokenizerLoadError, match="tokenizer_config.json has an auto_map .*trust_remote_code=False"):
        LLM(folder)
    assert not (folder / "tokenization_evil.py.PWNED").exists()


def byte_llm(**kwargs):
    from kimi_helix.tokenizer import build_byte_tokenizer

    return LLM(make_model(), tokenizer=build_byte_tokenizer(), **kwargs)


def test_stop_strings_cut_the_text_and_may_match_at_the_start():
    llm = byte_llm()
    prompt = prompts([6], seed=8)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(free.text) >= 4
    at_start = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop=free.text[0], ignore_eos=True))
    assert at_start[0].text == "" and at_start[0].finish_reason == "stop"
    stop = free.text[2:4]
    later = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert later.text == free.text[: free.text.find(stop)] and later.finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 0}, "max_model_len must be a positive int, got 0"),
        ({"max_model_len": 2**30}, "max_model_len=1073741824 exceeds the model's model_max_length"),
        ({"num_pages": 0}, "num_pages must be a positive int, got 0"),
        ({"dtype": torch.int8}, "dtype must be None (the model's) or one of float32, bfloat16, float16"),
        ({"dtype": "fp32"}, "got 'fp32'"),
        ({"device": "tpu"}, "device 'tpu' is not a device"),
        ({"device": "meta"}, "device must be on cpu or cuda, got 'meta'"),
        ({"device": 3.5}, "device must be None, a str"),
        ({"device_map": "balanced"}, "device_map must be None or 'auto', got 'balanced'"),
        ({"device_map": "auto"}, "a loaded model is already placed"),
    ],
)
def test_llm_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError) as info:
        LLM(make_model(), **kwargs)
    assert message in str(info.value)


def test_device_map_auto_is_passed_to_from_pretrained(monkeypatch, tiny_folder):
    seen = {}
    load = KimiK3ForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, path, **kwargs):
        seen.update(kwargs)
        return load(cls, path, dtype=kwargs["dtype"])  # the CPU-only placement "auto" chooses here

    monkeypatch.setattr(KimiK3ForCausalLM, "from_pretrained", classmethod(from_pretrained))
    llm = LLM(tiny_folder, device_map="auto")
    assert seen == {"dtype": None, "device_map": "auto"}
    assert llm.device == torch.device("cpu")
    with pytest.raises(ValueError, match="pass device_map='auto' or device='cpu', not both"):
        LLM(tiny_folder, device_map="auto", device="cpu")


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([1.7, 2.2], None, "prompt token ids must be ints, got [1.7, 2.2]"),
        ([1, True], None, "got [True]"),
        (torch.tensor([1.0, 2.0]), None, "a prompt must be a str or a list of token ids, got Tensor"),
        ({1, 2}, None, "got set"),
        ([1, 128], None, "prompt token ids must be in [0, 128)"),
        ("text", None, "string prompts need a tokenizer"),
        ([1, 2], SamplingParams(stop=["x"]), "SamplingParams.stop=['x'] needs a tokenizer"),
        ([1, 2], {"max_tokens": 3}, "sampling_params must be SamplingParams, got dict"),
    ],
)
def test_bad_prompts_are_refused(prompt, params, message):
    llm = LLM(make_model())
    with pytest.raises(ValueError) as info:
        llm.generate([prompt], params)
    assert message in str(info.value)
    assert not llm.scheduler.has_work


def test_integer_like_token_ids_are_accepted():
    import numpy as np

    llm = LLM(make_model())
    ids = prompts([7], seed=10)[0]
    expected = llm.generate([ids], GREEDY)[0].token_ids
    assert llm.generate([np.array(ids)[i] for i in range(len(ids))], GREEDY)[0].token_ids == expected
    assert llm.generate([torch.tensor(ids)], GREEDY)[0].token_ids == expected


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_failed_generate_frees_its_requests(monkeypatch, error):
    model = make_model()
    ps = prompts([5, 30, 12], seed=11)
    expected = [o.token_ids for o in LLM(model).generate(ps, GREEDY)]
    llm = LLM(model, page_size=8, max_num_seqs=2, max_num_batched_tokens=16)
    real_step, calls = LLM.step, []

    def failing_step(self):
        calls.append(1)
        if len(calls) == 3:  # after some requests were admitted and prefilled, one still waiting
            raise error
        return real_step(self)

    monkeypatch.setattr(LLM, "step", failing_step)
    with pytest.raises(type(error)):
        llm.generate(ps, GREEDY)
    assert not llm.scheduler.has_work
    assert llm.cache.ledger.pages_in_use == 0 and not llm.cache.ledger.seqs
    assert len(llm.cache.ledger.free_slots) == 2
    monkeypatch.setattr(LLM, "step", real_step)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == expected


def test_concurrent_generate_calls_run_one_after_another():
    import threading

    model = make_model()
    batches = [prompts([4 + i, 20 - i], seed=20 + i) for i in range(4)]
    expected = [[o.token_ids for o in LLM(model).generate(b, GREEDY)] for b in batches]
    llm = LLM(model, max_num_seqs=2, max_num_batched_tokens=16)
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            results[i] = [o.token_ids for o in llm.generate(batches[i], GREEDY)]
        except BaseException as err:  # surfaced by the assert below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert [results[i] for i in range(len(batches))] == expected
    assert llm.cache.ledger.pages_in_use == 0
