"""The `kimi_helix` lm-eval model against the model's own log-softmax, lm-eval's rolling windows and plain LLM."""

import math

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from kimi_helix import KimiK3ForCausalLM  # noqa: E402
from kimi_helix.engine import LLM, SamplingParams  # noqa: E402
from kimi_helix.evals.lm_eval_model import KimiHelixLM  # noqa: E402


@pytest.fixture(scope="module")
def lm(tiny_checkpoint):
    return KimiHelixLM(pretrained=str(tiny_checkpoint), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return KimiK3ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, device="cpu").eval()


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V] log-softmax of the model's logits: row j predicts ids[j + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1)


def reference_score(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    rows = token_logprobs(model, context + continuation)[len(context) - 1 :]
    picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(continuation)).all())


def test_loglikelihood_equals_log_softmax_sums(lm, hf_model):
    pairs = [("def f(x):\n", "    return x"), ("The capital of France is", " Paris"), ("", "abc"), ("a b ", "c")]
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    tok = lm.tokenizer
    for (ctx, cont), (logprob, greedy) in zip(pairs, got):
        # The byte tokenizer splits text into bytes; lm-eval moves the context's trailing spaces into the
        # continuation and conditions an empty context on the prefix (BOS) token.
        stripped = ctx.rstrip()
        cont_ids = tok.encode(ctx[len(stripped) :] + cont)
        ctx_ids = tok.encode(stripped) if stripped else [tok.bos_token_id]
        want, want_greedy = reference_score(hf_model, ctx_ids, cont_ids)
        assert logprob == pytest.approx(want, abs=1e-5)
        assert greedy == want_greedy


def test_greedy_continuation_is_flagged_greedy(lm, hf_model):
    ctx = lm.tokenizer.encode("for i in range(")
    greedy = LLM(hf_model).generate([ctx], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].token_ids
    [(_, is_greedy)] = lm._score_token_pairs([(ctx, greedy)])
    assert is_greedy
    [(_, not_greedy)] = lm._score_token_pairs([(ctx, [(greedy[0] + 1) % 256, *greedy[1:]])])
    assert not not_greedy


def test_rolling_equals_whole_document_sum_when_it_fits(lm, hf_model):
    text = "import os\nprint(os.getcwd())\n"
    [got] = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    ids = [lm.tokenizer.bos_token_id, *lm.tokenizer.encode(text)]
    rows = token_logprobs(hf_model, ids)
    # fp32 sums of ~30 token logprobs: relative, since the thread count changes the reduction order
    assert got == pytest.approx(rows[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item(), rel=1e-6)


def test_rolling_follows_lm_eval_windows_beyond_max_length(tiny_checkpoint, hf_model):
    lm = KimiHelixLM(pretrained=str(tiny_checkpoint), dtype="float32", device="cpu", max_length=16)
    text = "".join(f"line {i}: value = {i * i}\n" for i in range(4))  # 70 bytes: 5 windows of 16
    [got] = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    ids = lm.tokenizer.encode(text)
    windows = list(map(make_disjoint_window, get_rolling_token_windows(ids, lm.tokenizer.bos_token_id, 16, 1)))
    assert len(windows) > 2 and sum(len(cont) for _, cont in windows) == len(ids)
    want = sum(reference_score(hf_model, ctx, cont)[0] for ctx, cont in windows)
    assert got == pytest.approx(want, abs=1e-4)
    # Each window conditions on at most 16 tokens, so the total differs from the unwindowed sum.
    whole = token_logprobs(hf_model, [lm.tokenizer.bos_token_id, *ids])
    unwindowed = whole[torch.arange(len(ids)), torch.tensor(ids)].sum().item()
    assert not math.isclose(got, unwindowed, abs_tol=1e-3)


def test_generate_until_equals_plain_llm_greedy(lm, hf_model):
    context = "while True:\n"
    ids = lm.tokenizer.encode(context)
    plain = LLM(hf_model, tokenizer=lm.tokenizer).generate([ids], SamplingParams(max_tokens=24, temperature=0))[0]
    [free] = lm.generate_until(requests("generate_until", [(context, {"until": [], "max_gen_toks": 24})]))
    assert free == plain.text
    stop = plain.text[8:10]  # a stop string the greedy text produces
    [stopped] = lm.generate_until(requests("generate_until", [(context, {"until": [stop], "max_gen_toks": 24})]))
    assert stopped == plain.text[: plain.text.find(stop)]


def test_generate_until_with_speculative_decoding_equals_greedy(tiny_checkpoint, lm):
    spec = KimiHelixLM(
        pretrained=str(tiny_checkpoint),
        dtype="float32",
        device="cpu",
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    args = [
        ("a = 1\nb = 2\na = 1\n", {"until": [], "max_gen_toks": 20}),
        ("x", {"until": ["\n\n"], "max_gen_toks": 20}),
    ]
    assert spec.generate_until(requests("generate_until", args)) == lm.generate_until(requests("generate_until", args))


@pytest.mark.parametrize(("arg", "value"), [("dtype", "fp64"), ("tp", 0), ("max_length", 1), ("batch_size", "big")])
def test_bad_model_args_name_the_field(tiny_checkpoint, arg, value):
    with pytest.raises(ValueError, match=arg):
        KimiHelixLM(pretrained=str(tiny_checkpoint), device="cpu", **{arg: value})
