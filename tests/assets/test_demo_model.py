"""The shipped demo model: it loads like any checkpoint, its logits are the committed ones, it writes text."""

from __future__ import annotations

import json

import pytest
import torch

from kimi_helix.assets import DEMO_DIR, DEMO_WEIGHTS, demo_model_dir
from kimi_helix.assets.demo_recipe import logit_fingerprint

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / DEMO_WEIGHTS).is_file(), reason="the demo model's weights are not committed yet"
)


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoTokenizer

    from kimi_helix.modeling.model import KimiK3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir(), trust_remote_code=False)
    model = KimiK3ForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32).eval()
    return model, tokenizer


def test_logits_of_a_heldout_snippet_match_the_committed_values(demo):
    model, tokenizer = demo
    expected = json.loads((DEMO_DIR / "expected_logits.json").read_text())
    ids = tokenizer(expected["text"], add_special_tokens=False)["input_ids"]
    assert ids == expected["token_ids"], "the shipped tokenizer no longer encodes the snippet the same way"
    got = logit_fingerprint(model, ids, top=len(expected["last_top_ids"]))
    assert got["last_top_ids"] == expected["last_top_ids"]
    for key in ("next_token_logits", "last_top_logits"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(expected[key]), rtol=0, atol=1e-4)


def test_generate_writes_valid_utf8(demo):
    model, tokenizer = demo
    prompt = tokenizer("def fibonacci(n):", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    new_ids = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert new_ids, "generate produced no tokens"
    # Byte-level tokens decode their joined bytes with errors='replace': U+FFFD marks a broken UTF-8 sequence.
    raw = tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens(new_ids, skip_special_tokens=True))
    assert "\ufffd" not in raw
