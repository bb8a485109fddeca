"""`logprobs` and `prompt_logprobs` (vLLM meaning) equal the model's own log-softmax, before temperature."""

import pytest
import torch

from kimi_helix.engine import LLM, SamplingParams
from kimi_helix.engine.sampling import logprobs_of

from .test_llm import make_model, prompts


def model_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_entry(entry, logp_row, token, n):
    """One position's dict: the actual token plus the top n, each with the model's logprob and rank."""
    top = logp_row.topk(n).indices.tolist() if n else []
    assert set(entry) == {token, *top}
    for tid, item in entry.items():
        assert abs(item.logprob - logp_row[tid].item()) <= 1e-5
        assert item.rank == int((logp_row > logp_row[tid]).sum()) + 1
        assert item.decoded_token is None  # no tokenizer


@pytest.mark.parametrize("n", [0, 3])
def test_logprobs_and_prompt_logprobs_match_log_softmax(n):
    model = make_model()
    ps = prompts([23, 9], seed=31)
    # Sampled at temperature 0.7 with top-p: the logprobs are still the raw model's.
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=3, logprobs=n, prompt_logprobs=n)
    outs = LLM(model, page_size=8, max_num_batched_tokens=10).generate(ps, params)  # 23 tokens: three chunks
    for p, out in zip(ps, outs):
        ids = p + out.token_ids
        logp = model_logprobs(model, ids)
        assert len(out.logprobs) == len(out.token_ids)
        for j, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
            check_entry(entry, logp[len(p) - 1 + j], token, n)
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        for j in range(1, len(p)):
            check_entry(out.prompt_logprobs[j], logp[j - 1], p[j], n)


def test_without_the_fields_outputs_carry_no_logprobs():
    out = LLM(make_model()).generate(prompts([5]), SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.logprobs is None and out.prompt_logprobs is None


def test_greedy_tokens_have_rank_one():
    out = LLM(make_model()).generate(prompts([12], seed=32), SamplingParams(max_tokens=5, temperature=0, logprobs=0))
    assert [e[t].rank for e, t in zip(out[0].logprobs, out[0].token_ids)] == [1] * len(out[0].token_ids)


def test_logprobs_of_ranks_ties_and_decoded_text():
    logits = torch.tensor([[2.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    rows = logprobs_of(logits, [1, 0], [2, 0], decode=lambda t: f"<{t}>")
    assert set(rows[0]) == {0, 1, 2} and rows[0][1].rank == 3 and rows[0][1].decoded_token == "<1>"
    assert rows[0][0].rank == rows[0][2].rank == 1  # tied tokens share a rank
    assert rows[1][0].rank == 2 and set(rows[1]) == {0}  # rank counts strictly larger logprobs only
    assert abs(rows[1][0].logprob - torch.log_softmax(logits[1], -1)[0].item()) < 1e-7


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_logprob_counts_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be None or an int >= 0"):
        SamplingParams(**{field: value})
