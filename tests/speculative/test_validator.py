"""Table test of the speculative validator: every row is a configuration and the reason it must (not) give."""

from __future__ import annotations

import dataclasses

import pytest

from kimi_helix.kernels import backends
from kimi_helix.presets import get_preset
from kimi_helix.speculative.dspark.config import DSparkConfig
from kimi_helix.speculative.validator import UnsupportedConfigError, validate_speculative_config

TARGET = get_preset("tiny").to_dict()  # 4 layers (KDA, KDA, MLA, KDA), vocab 320, d 64, 4 MLA / 2 KDA heads
DRAFTER = {
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "head_dim": 16,
    "intermediate_size": 128,
    "target_layer_ids": [0, 2],
    "target_num_hidden_layers": 4,
    "block_size": 5,
    "mask_token_id": 258,
    "markov_rank": 8,
    "enable_confidence_head": True,
}
DSPARK = {"method": "dspark", "model": "draft", "num_speculative_tokens": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _target(**kw):
    t = dict(TARGET)
    lac = dict(t["linear_attn_config"])
    lac.update(kw.pop("lac", {}))
    t["linear_attn_config"] = lac
    t.update(kw)
    return t


def _drafter(**kw):
    return {**DRAFTER, **kw}


# (id, spec, target, drafter, options, expected): expected None = allowed, else (field, substring of the problem).
ROWS = [
    ("dspark-ok", DSPARK, TARGET, DRAFTER, {}, None),
    ("dspark-k1", {**DSPARK, "num_speculative_tokens": 1}, TARGET, DRAFTER, {}, None),
    ("dspark-k-block", {**DSPARK, "num_speculative_tokens": 5}, TARGET, DRAFTER, {}, None),
    ("dspark-k8", {**DSPARK, "num_speculative_tokens": 8}, TARGET, _drafter(block_size=16), {}, None),
    ("ngram-ok", NGRAM, TARGET, None, {}, None),
    ("ngram-n-range", {**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 5}, TARGET, None, {}, None),
    ("conf-sched-ok", {**DSPARK, "confidence_scheduling": True}, TARGET, DRAFTER, {}, None),
    ("drafter-object", DSPARK, get_preset("tiny"), DSparkConfig(**DRAFTER), {}, None),
    ("cp2-dspark", DSPARK, TARGET, DRAFTER, {"cp": 2}, None),
    ("tp2", DSPARK, TARGET, DRAFTER, {"tp": 2}, None),
    ("tp2-cp2-divisible", DSPARK, _target(lac={"num_heads": 4}), DRAFTER, {"tp": 2, "cp": 2}, None),
    ("fp32-cpu", DSPARK, TARGET, DRAFTER, {"dtype": "fp32"}, None),
    ("fp8-kv", DSPARK, TARGET, DRAFTER, {"kv_dtype": "fp8_e4m3"}, None),
    ("forced-torch", {**DSPARK, "attention_backend": "torch"}, TARGET, DRAFTER, {}, None),
    ("tree", {**DSPARK, "drafting": "tree"}, TARGET, DRAFTER, {}, ("drafting", "tree")),
    ("token-tree", {**DSPARK, "speculative_token_tree": [[0]]}, TARGET, DRAFTER, {}, ("drafting", "tree")),
    ("eagle3", {**DSPARK, "method": "eagle3"}, TARGET, DRAFTER, {}, ("method", "unknown")),
    ("no-method", {"num_speculative_tokens": 3}, TARGET, DRAFTER, {}, ("method", "unknown")),
    ("typo-key", {**DSPARK, "num_spec_tokens": 3}, TARGET, DRAFTER, {}, ("num_spec_tokens", "unknown key")),
    ("k0", {**DSPARK, "num_speculative_tokens": 0}, TARGET, DRAFTER, {}, ("num_speculative_tokens", "1..5")),
    ("k-negative", {**NGRAM, "num_speculative_tokens": -2}, TARGET, None, {}, ("num_speculative_tokens", "1..8")),
    ("k-over-block", {**DSPARK, "num_speculative_tokens": 6}, TARGET, DRAFTER, {}, ("num_speculative_tokens", "block")),
    (
        "k9",
        {**DSPARK, "num_speculative_tokens": 9},
        TARGET,
        _drafter(block_size=16),
        {},
        ("num_speculative_tokens", "1..8"),
    ),
    ("k9-ngram", {**NGRAM, "num_speculative_tokens": 9}, TARGET, None, {}, ("num_speculative_tokens", "1..8")),
    ("k-float", {**NGRAM, "num_speculative_tokens": 2.0}, TARGET, None, {}, ("num_speculative_tokens", "out of range")),
    (
        "ngram-min-max",
        {**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        TARGET,
        None,
        {},
        ("prompt_lookup", "min <= max"),
    ),
    ("ngram-min0", {**NGRAM, "prompt_lookup_min": 0}, TARGET, None, {}, ("prompt_lookup", "1 <= min")),
    (
        "rank0-conf",
        {**DSPARK, "confidence_scheduling": True},
        TARGET,
        _drafter(markov_rank=0),
        {},
        ("confidence_scheduling", "Markov"),
    ),
    (
        "no-conf-head",
        {**DSPARK, "confidence_scheduling": True},
        TARGET,
        _drafter(enable_confidence_head=False),
        {},
        ("confidence_scheduling", "no confidence head"),
    ),
    ("ngram-conf", {**NGRAM, "confidence_scheduling": True}, TARGET, None, {}, ("confidence_scheduling", "ngram")),
    ("rank0-fixed-ok", DSPARK, TARGET, _drafter(markov_rank=0), {}, None),
    ("mask-oob", DSPARK, TARGET, _drafter(mask_token_id=320), {}, ("drafter.mask_token_id", "outside the vocab")),
    ("mask-negative", DSPARK, TARGET, _drafter(mask_token_id=-1), {}, ("drafter.mask_token_id", "outside the vocab")),
    ("vocab", DSPARK, TARGET, _drafter(vocab_size=512), {}, ("drafter.vocab_size", "!= target")),
    ("hidden", DSPARK, TARGET, _drafter(hidden_size=128), {}, ("drafter.hidden_size", "!= target")),
    (
        "final-layer",
        DSPARK,
        TARGET,
        _drafter(target_layer_ids=[0, 3]),
        {},
        ("drafter.target_layer_ids", "final layer 3"),
    ),
    ("layer-oob", DSPARK, TARGET, _drafter(target_layer_ids=[0, 7]), {}, ("drafter.target_layer_ids", "not layers")),
    ("layers-empty", DSPARK, TARGET, _drafter(target_layer_ids=[]), {}, ("drafter.target_layer_ids", "non-empty")),
    (
        "layer-count",
        DSPARK,
        TARGET,
        _drafter(target_num_hidden_layers=27),
        {},
        ("drafter.target_num_hidden_layers", "!="),
    ),
    ("no-drafter", DSPARK, TARGET, None, {}, ("model", "needs a drafter")),
    ("cp2-ngram", NGRAM, TARGET, None, {"cp": 2}, ("method", "standalone DSpark linear chain")),
    (
        "cp2-tree",
        {**DSPARK, "drafting": "tree"},
        TARGET,
        DRAFTER,
        {"cp": 2},
        ("method", "standalone DSpark linear chain"),
    ),
    ("mla-heads-tp3", DSPARK, TARGET, DRAFTER, {"tp": 3}, ("target.num_attention_heads", "tp*cp=3")),
    ("kda-heads-tp2cp2", DSPARK, TARGET, DRAFTER, {"tp": 2, "cp": 2}, ("target.kda num_heads", "tp*cp=4")),
    ("mla-heads-cp8", DSPARK, TARGET, DRAFTER, {"cp": 8}, ("target.num_attention_heads", "tp*cp=8")),
    ("tp0", DSPARK, TARGET, DRAFTER, {"tp": 0}, ("tp/cp", ">= 1")),
    (
        "forced-sdpa",
        {**DSPARK, "attention_backend": "sdpa"},
        TARGET,
        DRAFTER,
        {},
        ("attention_backend", "no verify kernel"),
    ),
    (
        "forced-unknown",
        {**DSPARK, "attention_backend": "flashmla"},
        TARGET,
        DRAFTER,
        {},
        ("attention_backend", "must be one of"),
    ),
    ("fp8-q", DSPARK, TARGET, DRAFTER, {"dtype": "fp8_e4m3"}, ("attention_backend", "q dtype")),
]


@pytest.mark.parametrize(
    ("spec", "target", "drafter", "options", "expected"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_validator_table(spec, target, drafter, options, expected):
    options = {"device": "cpu", **options}
    if expected is None:
        cfg = validate_speculative_config(spec, target, drafter, **options)
        assert cfg.method == spec["method"] and cfg.num_speculative_tokens == spec["num_speculative_tokens"]
        return
    with pytest.raises(UnsupportedConfigError) as info:
        validate_speculative_config(spec, target, drafter, **options)
    field, text = expected
    matching = [
        r for r in info.value.reasons if r.field.startswith(field) and text in f"{r.problem} (allowed: {r.allowed})"
    ]
    assert matching, f"no reason on {field!r} mentioning {text!r} in {info.value.reasons}"
    assert all(r.allowed for r in info.value.reasons), "every reason names the allowed alternatives"


def test_every_reason_is_listed_at_once():
    spec = {"method": "dspark", "num_speculative_tokens": 0, "drafting": "tree"}
    with pytest.raises(UnsupportedConfigError) as info:
        validate_speculative_config(spec, TARGET, _drafter(mask_token_id=999, vocab_size=512), device="cpu", tp=3)
    fields = {r.field for r in info.value.reasons}
    assert {"drafting", "num_speculative_tokens", "drafter.mask_token_id", "drafter.vocab_size"} <= fields
    assert "target.num_attention_heads" in fields
    assert str(info.value).count("\n  - ") == len(info.value.reasons)


@dataclasses.dataclass(frozen=True)
class _GapCaps(backends.KernelCaps):
    """A kernel whose real constraint is 'no 64 < H < 128' (e.g. whole 64-row tiles or a 128-head layout)."""

    def reasons(self, r):
        out = super().reasons(r)
        if 64 < r.num_heads < 128:
            out.append(f"num_heads={r.num_heads} in (64, 128)")
        return out


@pytest.fixture
def gap_kernel_registry(monkeypatch):
    real = backends.build_registry

    def registry():
        reg = real()
        base = reg["triton"].kernels["verify"]
        gap = _GapCaps(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        reg["gap"] = backends.Backend("gap", {**reg["triton"].kernels, "verify": gap})
        return reg

    monkeypatch.setattr(backends, "build_registry", registry)
    monkeypatch.setitem(backends.PRIORITY, "cpu", ("gap", "torch", "sdpa", "triton"))
    backends.select_backend.cache_clear()
    yield
    backends.select_backend.cache_clear()


def _k3_heads(heads: int) -> dict:
    # kv_lora_rank 32 and rope 16 fit the Triton verify kernel's latent rule, so only the head count decides.
    return _target(num_attention_heads=heads, num_key_value_heads=heads, qk_rope_head_dim=16)


@pytest.mark.parametrize(
    ("heads", "tp", "expected"), [(96, 1, "torch"), (64, 1, "gap"), (128, 1, "gap"), (192, 2, "torch"), (256, 2, "gap")]
)
def test_verify_backend_gated_on_kernel_constraint(gap_kernel_registry, monkeypatch, heads, tp, expected):
    """A kernel that rejects 64 < H < 128 is never chosen for a 96-head (per-rank) verify batch, whatever the
    batch holds; it is chosen where it can serve."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = validate_speculative_config(DSPARK, _k3_heads(heads), DRAFTER, device="cpu", dtype="fp32", tp=tp)
    assert cfg.verify_backend == expected


def test_forcing_the_gap_kernel_at_96_heads_is_rejected(gap_kernel_registry, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UnsupportedConfigError) as info:
        validate_speculative_config(
            {**DSPARK, "attention_backend": "gap"}, _k3_heads(96), DRAFTER, device="cpu", dtype="fp32"
        )
    assert any(r.field == "attention_backend" and "(64, 128)" in r.problem for r in info.value.reasons)
