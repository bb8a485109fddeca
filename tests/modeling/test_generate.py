"""generate(): equals a hand-written greedy loop; the cache reproduces the full forward; padding is invisible."""

import pytest
import torch

from kimi_helix import KimiK3Cache, KimiK3Config, KimiK3ForCausalLM

from .conftest import k3_kwargs, randomize_router_bias, rel_err, tiny_kwargs


def model_for(kwargs, seed=0):
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(KimiK3Config(**kwargs)).eval()
    randomize_router_bias(model, seed)
    return model


def greedy_without_cache(model, ids, n):
    """Full-recompute argmax decoding; EOS is banned, as `min_new_tokens=n` bans it in generate()."""
    for _ in range(n):
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[:, -1]
        logits[:, model.config.eos_token_id] = float("-inf")
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("kwargs", [tiny_kwargs(), k3_kwargs()], ids=["kimi-linear", "k3-style"])
def test_generate_equals_hand_written_greedy_loop(kwargs):
    model = model_for(kwargs)
    prompt = torch.randint(3, 128, (2, 67), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(out, greedy_without_cache(model, prompt, 24))


@pytest.mark.parametrize("kwargs", [tiny_kwargs(), k3_kwargs()], ids=["kimi-linear", "k3-style"])
def test_chunked_prefill_and_decode_equal_one_forward(kwargs):
    model = model_for(kwargs, seed=1)
    ids = torch.randint(3, 128, (2, 140), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = KimiK3Cache(model.config, batch_size=2)
        pieces = [model(ids[:, a:b], cache=cache).logits for a, b in [(0, 65), (65, 130), (130, 131)]]
        pieces += [model(ids[:, t : t + 1], cache=cache).logits for t in range(131, 140)]
    assert rel_err(torch.cat(pieces, dim=1), full) < 1e-5
    assert cache.get_seq_length() == 140


def test_left_padded_batch_equals_each_prompt_alone():
    model = model_for(tiny_kwargs(), seed=2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (5, 70, 33)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    batched = model.generate(
        ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
    )
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert torch.equal(batched[i, width:], alone[0, len(p) :]), i


def test_sampling_is_seeded():
    model = model_for(tiny_kwargs(), seed=3)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(prompt, max_new_tokens=10, do_sample=True, temperature=0.8, top_p=0.9))
    assert torch.equal(runs[0], runs[1])
