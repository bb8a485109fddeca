"""The end-to-end benchmark on the CPU: the grid's order, its skip and failure rows, the time budget, every row's
required fields, and transformers' KimiLinear (its reference torch KDA runs on the CPU without fla) with a cache
filled without a prefill. Nothing here checks what is measured."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

REQUIRED = {"gpu", "date", "commit", "layers", "batch", "context", "ms_per_step", "kernels_per_step", "floor_ms",
            "pct_of_floor"}  # fmt: skip


def _load(name: str = "bench_e2e"):
    """The script as a module (conftest puts scripts/ on sys.path, as the scripts themselves do)."""
    return importlib.import_module(name)


def test_grid_order_puts_the_important_cases_first():
    e2e = _load()
    cases = e2e.plan_cases((1, 64, 8, 256), (4096, 32768), (1, 8, 64), 32768)
    got = [(c.phase, c.batch, c.context) for c in cases]
    four_k = [("decode", 1), ("verify", 1), ("decode", 64), ("verify", 64), ("decode", 8), ("verify", 8),
              ("decode", 256)]  # fmt: skip
    assert got == [(p, b, c) for c in (4096, 32768) for p, b in four_k] + [("prefill", 1, 32768)]
    assert [c.phase for c in e2e.plan_cases((1,), (16,), (), None)] == ["decode"]


def test_budget_skips_a_case_the_time_left_cannot_cover():
    now = [0.0]
    budget = _load().Budget(100, clock=lambda: now[0])
    assert budget.skip_reason("decode") is None  # nothing measured yet: any time left will do
    now[0] = 30.0
    budget.record("decode", 40.0)
    assert budget.skip_reason("decode") is None and budget.skip_reason("verify") is None  # 30 + 40 < 100
    now[0] = 70.0
    assert budget.skip_reason("decode") == "time budget: 70 of 100 s spent, a decode case took up to 40 s"
    assert budget.skip_reason("verify") is None
    now[0] = 100.0
    assert budget.skip_reason("verify") is not None
    assert _load().Budget(None).skip_reason("decode") is None


def test_cpu_run_writes_every_case_skips_and_failures(tmp_path, capsys, monkeypatch):
    """One tiny run: transformers' rows, decode and verify rows with every required field and their ratios, the
    prefill row; a case that raises becomes a `failed` row and the run goes on; a spent budget skips the rest."""
    e2e = _load()
    real = e2e.bench_verify

    def verify_fails_at_batch_2(model, args, case, *rest):
        if case.batch == 2:
            raise RuntimeError("no verify at batch 2")
        return real(model, args, case, *rest)

    monkeypatch.setattr(e2e, "bench_verify", verify_fails_at_batch_2)
    monkeypatch.setitem(e2e.BENCH, "verify", verify_fails_at_batch_2)
    out = tmp_path / "e2e.jsonl"
    argv = ["--device", "cpu", "--preset", "tiny", "--layers", "3", "--batches", "1,2", "--out", str(out)]
    assert e2e.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for r in rows:
        assert set(r) >= REQUIRED, sorted(REQUIRED - set(r))
        assert r["layers"] == 3
    hf = [r for r in rows if str(r.get("mode")).startswith("transformers")]
    ours = [r for r in rows if r["phase"] == "decode" and r.get("mode") == "eager"]
    verify = [r for r in rows if r["phase"] == "verify"]
    prefill = [r for r in rows if r["phase"] == "prefill"]
    assert [(r["batch"], r["context"]) for r in hf] == [(1, 16)] and hf[0]["ms_per_step"] > 0
    assert hf[0]["build_s"] >= 0 and hf[0]["prefill_s"] >= 0 and hf[0]["warmup_s"] >= 0 and hf[0]["floor_ms"] > 0
    assert [(r["batch"], r["context"]) for r in ours] == [(1, 16), (2, 16)]
    for r in ours:
        assert r["ms_per_step"] > 0 and r["floor_ms"] > 0 and r["pct_of_floor"] > 0 and r["case_s"] >= 0
        assert r["experts_touched_mean"] >= 1
    assert ours[0]["speedup_vs_hf"] == round(hf[0]["ms_per_step"] / ours[0]["ms_per_step"], 2)
    ok, failed = verify
    assert ok["draft_tokens"] == 4 and ok["verify_over_decode"] == round(ok["ms_per_step"] / ours[0]["ms_per_step"], 3)
    assert ok["floor_ms"] > ours[0]["floor_ms"]
    assert failed["batch"] == 2 and failed["failed"] == "RuntimeError: no verify at batch 2"
    assert failed["ms_per_step"] is None and "case_s" in failed
    assert len(prefill) == 1 and prefill[0]["prefill_tokens_per_s"] > 0
    assert "| case |" in capsys.readouterr().out

    # a budget already spent: every case gets a skipped row naming the budget, and still the required fields
    out.unlink()
    assert e2e.main([*argv, "--budget-s", "0", "--no-prefill", "--verify-k", "0"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["phase"], r["batch"]) for r in rows] == [("decode", 1)] * 2 + [("decode", 2)]
    assert all(r["skipped"].startswith("time budget") and set(r) >= REQUIRED for r in rows)


def test_top_kernels_are_printed_and_kept_for_decode_and_verify_rows(capsys):
    e2e = _load()
    top = [dict(kernel="moe_gate_up_kernel", calls=26.0, us=650.0), dict(kernel="linear_kernel", calls=76.0, us=350.0)]
    assert e2e.top_kernels_fields(top, e2e.Case("verify", 64, 4096), 2.5) == {"top_kernels": top}
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "verify, batch 64, context 4096: top 2 kernels, 1.000 of 2.500 ms per step"
    assert "650.0 us" in printed[1] and printed[1].endswith("moe_gate_up_kernel")
    assert e2e.top_kernels_fields([], e2e.Case("decode", 1, 4096), 2.5) == {}


def test_a_cache_that_does_not_fit_is_skipped(monkeypatch):
    """The fit check prices pages, states and the verify scratch with the planner's functions."""
    e2e = _load()
    config = e2e.truncated_config("kimi-linear-48b-a3b", None)
    args = e2e.parse_args(["--device", "cpu"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 << 30, 140 << 30))
    cuda = torch.device("cuda")
    assert e2e.fit_reason(config, args, 64, 32768 + 200, 4, 2, cuda) is None  # 17 GB of pages + 14 GB of scratch
    why = e2e.fit_reason(config, args, 256, 32768 + 200, 0, 2, cuda)  # 68 GB of pages
    assert why.startswith("does not fit: cache, states and verify scratch 7")
    assert e2e.fit_reason(config, args, 256, 32768, 0, 2, torch.device("cpu")) is None


def test_layers_truncate_the_preset():
    config = _load().truncated_config("kimi-linear-48b-a3b", 5)
    assert config.num_hidden_layers == 5 and config.layer_types.count("full_attention") == 1


def test_hf_cache_filled_without_a_prefill_gives_the_prefill_logits():
    """transformers' KimiLinear: a cache filled through the Cache methods with a real prefill's tensors decodes the
    next tokens exactly as the prefilled cache does; so the benchmark's random fill takes the real decode path."""
    pytest.importorskip("transformers.models.kimi_linear")
    from transformers.cache_utils import DynamicCache

    hf = _load("bench_e2e_hf")
    torch.manual_seed(0)
    model = hf.build_hf_model("tiny", None, torch.float32, torch.device("cpu"))
    kw = hf.cache_keyword(model)
    prefilled = DynamicCache(config=model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        token = model(input_ids=ids, use_cache=True, **{kw: prefilled}).logits[:, -1:].argmax(-1)

    def take(kind, layer, shape, dtype, device, g):
        cached = prefilled.layers[layer]
        tensor = dict(latent=lambda: cached.keys, rope=lambda: cached.values, conv=lambda: cached.conv_states[0],
                      recurrent=lambda: cached.recurrent_states[0])[kind]()  # fmt: skip
        assert tuple(tensor.shape) == shape and tensor.dtype == dtype
        return tensor.clone()

    filled = hf.fill_hf_cache(model, 2, 9, make=take)
    with torch.no_grad():
        for _ in range(2):
            want = model(input_ids=token, use_cache=True, **{kw: prefilled}).logits
            got = model(input_ids=token, use_cache=True, **{kw: filled}).logits
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            token = want[:, -1:].argmax(-1)
