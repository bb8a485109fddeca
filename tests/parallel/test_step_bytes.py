"""`helix.step_bytes`, the bytes formula of docs/helix.md, gives the numbers the docs' worked table states."""

from kimi_helix.parallel.helix import step_bytes
from kimi_helix.presets import get_preset


def test_docs_table_of_the_tiny_preset():
    tiny = get_preset("tiny")  # N = 4, L_mla = 1, d = 64, V = 320, H = 4, r = 32
    prefill = step_bytes(tiny, tp=1, cp=2, tokens=18, logit_rows=1, sampled=1, itemsize=4)
    assert prefill == {"all_reduce": 41472, "all_gather": 640, "all_to_all": 4752, "broadcast": 8}
    decode = step_bytes(tiny, tp=1, cp=2, tokens=1, logit_rows=1, sampled=1, itemsize=4)
    assert sum(decode.values()) == 3216
    assert "broadcast" not in step_bytes(tiny, tp=1, cp=2, tokens=1, logit_rows=1, sampled=1, itemsize=4, rank=1)


def test_all_to_all_only_under_cp_and_nothing_on_one_rank():
    tiny = get_preset("tiny")
    assert "all_to_all" not in step_bytes(tiny, tp=2, cp=1, tokens=3, logit_rows=3, sampled=3, itemsize=2)
    assert step_bytes(tiny, tp=1, cp=1, tokens=3, logit_rows=3, sampled=3, itemsize=2) == {}
