import json

import pytest
import torch

from kimi_helix.cli import main
from kimi_helix.engine.planner import (
    KV_CACHE_DTYPES,
    VERIFY_GRAPH_MAX_TOKENS,
    cache_bytes_per_token,
    kda_state_bytes_per_rank,
    parse_bytes,
    plan_memory,
    verify_graph_tokens,
    verify_scratch_bytes_per_token,
)
from kimi_helix.modeling.accounting import count_parameters
from kimi_helix.presets import PRESETS, get_preset

# Kimi-Linear-48B-A3B, worked by hand (reference kimi_linear.md sections 1-3).
PARAMS = 49_122_681_728
MLA_BF16 = 7 * 576 * 2  # 7 MLA layers x (512 latent + 64 rope) x bf16 = 8064
MLA_FP8 = 7 * (576 * 1 + 4)  # e4m3 values + one fp32 scale per token per MLA layer = 4060
KDA_STATE = 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2)  # 20 KDA layers x (fp32 state + bf16 conv) = 43,417,600
GPU = 141 * 10**9
USABLE = 126_900_000_000  # x 0.9
# 2048 batched tokens x 4 buffers x 18432 (the dense MLP's gate+up) x bf16, + 256 rows x 163840 logits x 32 B.
ACTIVATIONS = 2048 * 4 * 18432 * 2 + 256 * 163840 * 32


@pytest.fixture(scope="module")
def k48():
    return get_preset("kimi-linear-48b-a3b")


def test_parse_bytes():
    assert parse_bytes("141GB") == 141_000_000_000
    assert parse_bytes("141GiB") == 141 * 2**30
    assert parse_bytes("80e9") == 80_000_000_000
    assert parse_bytes(" 1.5 gib ") == 3 * 2**29
    assert parse_bytes("512MiB") == 2**29
    assert parse_bytes("4096") == 4096
    assert parse_bytes(12345) == 12345


@pytest.mark.parametrize("bad", ["", "GB", "141XB", "1..5GB", "nan", "-5GB", "0", "0.1B", 0, -3, True, 1.5e9])
def test_parse_bytes_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=f"{bad!r}".replace(".", r"\.")):
        parse_bytes(bad)


def test_kimi_linear_48b_bf16_on_one_141gb_gpu(k48):
    assert count_parameters(k48)[0] == PARAMS
    plan = plan_memory(k48, "141GB")
    assert plan.usable_bytes == USABLE
    assert plan.weight_bytes_per_rank == PARAMS * 2 == 98_245_363_456
    assert plan.draft_weight_bytes == 0
    assert plan.activation_reserve_bytes == ACTIVATIONS == 1_644_167_168
    assert plan.free_bytes_for_cache == USABLE - PARAMS * 2 - ACTIVATIONS == 27_010_469_376
    assert plan.mla_cache_bytes_per_token == plan.mla_cache_bytes_per_token_per_rank == MLA_BF16 == 8064
    assert plan.kda_state_bytes_per_sequence_per_rank == KDA_STATE == 43_417_600
    assert plan.page_bytes == 64 * 8064
    # Tokens: the KDA state of 256 sequences first, then whole pages.
    pages = (27_010_469_376 - 256 * KDA_STATE) // (64 * 8064)
    assert plan.num_pages_per_rank == pages == 30_799
    assert plan.max_concurrent_tokens == pages * 64 == 1_971_136
    # Sequences of the config's 1M tokens: 16384 pages + the state each.
    assert plan.max_model_len == 1_048_576
    assert plan.mla_cache_bytes_per_sequence_per_rank == 16384 * 64 * 8064
    assert plan.max_concurrent_sequences == 27_010_469_376 // (16384 * 64 * 8064 + KDA_STATE) == 3


def test_tp2_cp2_divides_weights_state_and_tokens(k48):
    plan = plan_memory(k48, GPU, tp=2, cp=2)
    assert plan.world_size == 4
    assert plan.weight_bytes_per_rank == PARAMS * 2 // 4 == 24_561_340_864
    assert plan.mla_cache_bytes_per_token == 8064  # the latent is whole on every TP rank
    assert plan.mla_cache_bytes_per_token_per_rank == 8064 / 2
    assert plan.kda_state_bytes_per_sequence_per_rank == KDA_STATE // 4 == 10_854_400
    free = USABLE - PARAMS * 2 // 4 - ACTIVATIONS
    assert plan.free_bytes_for_cache == free
    pages = (free - 256 * KDA_STATE // 4) // (64 * 8064)
    assert plan.num_pages_per_rank == pages
    assert plan.max_concurrent_tokens == pages * 64 * 2  # each rank holds every other page
    assert plan.mla_cache_bytes_per_sequence_per_rank == 8192 * 64 * 8064
    assert plan.max_concurrent_sequences == free // (8192 * 64 * 8064 + KDA_STATE // 4)


@pytest.mark.parametrize(("length", "rank0_pages"), [(1, 1), (64, 1), (65, 1), (129, 2), (1000, 8), (1025, 9)])
def test_a_sequence_costs_rank0_its_share_of_pages_rounded_up(k48, length, rank0_pages):
    plan = plan_memory(k48, GPU, cp=2, max_model_len=length)
    assert plan.mla_cache_bytes_per_sequence_per_rank == rank0_pages * 64 * 8064


def test_fp8_kv_cache(k48):
    plan = plan_memory(k48, GPU, kv_cache_dtype="fp8_e4m3")
    assert plan.mla_cache_bytes_per_token == MLA_FP8 == 4060
    assert plan.page_bytes == 64 * 4060
    assert plan.kda_state_bytes_per_sequence_per_rank == KDA_STATE  # the state is not fp8
    assert plan.num_pages_per_rank == (27_010_469_376 - 256 * KDA_STATE) // (64 * 4060)
    assert plan_memory(k48, GPU, cp=4, kv_cache_dtype="fp8_e4m3").mla_cache_bytes_per_token_per_rank == 1015


def test_float32_doubles_weights_and_conv_state(k48):
    plan = plan_memory(k48, "1TB", dtype=torch.float32)
    assert plan.weight_bytes_per_rank == PARAMS * 4
    assert plan.mla_cache_bytes_per_token == 7 * 576 * 4
    assert plan.kda_state_bytes_per_sequence_per_rank == 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 4)


def test_draft_weights_are_added_unsharded(k48):
    tiny = get_preset("tiny")
    plan = plan_memory(k48, GPU, tp=2, draft_config=tiny)
    assert plan.draft_weight_bytes == count_parameters(tiny)[0] * 2
    assert plan.weight_bytes_per_rank == PARAMS + count_parameters(tiny)[0] * 2


def test_weights_too_big_names_gpu_memory_bytes(k48):
    with pytest.raises(ValueError, match=r"gpu_memory_bytes=80,000,000,000 .* weights alone"):
        plan_memory(k48, "80GB")
    # The weights fit, the activation reserve does not.
    with pytest.raises(ValueError, match=r"gpu_memory_bytes=.* activation reserve"):
        plan_memory(k48, PARAMS * 2 + 10**6, gpu_memory_utilization=1.0)


def test_state_for_max_num_seqs_can_leave_no_token_room(k48):
    plan = plan_memory(k48, PARAMS * 2 + ACTIVATIONS + 10 * KDA_STATE, gpu_memory_utilization=1.0)
    assert plan.max_concurrent_tokens == plan.num_pages_per_rank == 0
    assert plan.max_concurrent_sequences == 0  # and no 1M-token sequence fits either


# A verify token's KDA scratch: the state after it plus its conv input per layer (20 x 3 x 4096 x bf16).
VERIFY_TOKEN = KDA_STATE + 20 * 3 * 4096 * 2  # 43,909,120


def test_verify_scratch_is_priced_only_for_verify_graphs(k48):
    """A plan without drafts (an eager engine, or one without speculative decoding) keeps every byte for the
    cache; with drafts, batch x (1 + k) tokens of verify scratch come out of it, capped by the step's budget."""
    plain = plan_memory(k48, "141GB")
    assert plain.max_draft_tokens == plain.verify_scratch_bytes == 0
    assert verify_scratch_bytes_per_token(k48, 1, 2) == VERIFY_TOKEN == 43_909_120
    spec = plan_memory(k48, "141GB", max_num_seqs=64, max_draft_tokens=4)
    assert spec.verify_scratch_bytes == 64 * 5 * VERIFY_TOKEN  # batch 64 at k = 4 is graphed: 14 GB
    base = plan_memory(k48, "141GB", max_num_seqs=64)
    assert spec.free_bytes_for_cache == base.free_bytes_for_cache - spec.verify_scratch_bytes
    assert spec.num_pages_per_rank < base.num_pages_per_rank
    # 256 sequences x 9 tokens: the step budget (2048) and then the cap bound the scratch
    assert plan_memory(k48, "141GB", max_draft_tokens=8).verify_scratch_bytes == 512 * VERIFY_TOKEN
    half = plan_memory(k48, "141GB", max_draft_tokens=8, max_num_batched_tokens=256, tp=2)
    assert half.verify_scratch_bytes == 256 * verify_scratch_bytes_per_token(k48, 2, 2) == 256 * VERIFY_TOKEN // 2
    with pytest.raises(ValueError, match="max_draft_tokens must"):
        plan_memory(k48, GPU, max_draft_tokens=-1)
    with pytest.raises(ValueError, match=r"verify scratch \(.*max_draft_tokens=8\)"):
        plan_memory(k48, PARAMS * 2 + ACTIVATIONS + 10**6, gpu_memory_utilization=1.0, max_draft_tokens=8)


def test_the_engine_sets_verify_scratch_aside_only_for_verify_graphs(monkeypatch):
    """`LLM._default_num_pages` takes the planner's verify scratch out of free memory only when verify steps are
    graphed (draft_tokens > 0, which `LLM.__init__` passes only with graphs on and speculative decoding or
    `max_draft_tokens` configured): a plain engine keeps every page."""
    from kimi_helix import KimiK3Config, KimiK3ForCausalLM
    from kimi_helix.engine import LLM

    from ..modeling.conftest import tiny_kwargs

    config = KimiK3Config(**tiny_kwargs())
    llm = LLM(KimiK3ForCausalLM(config).eval(), max_num_seqs=4, max_model_len=32, page_size=16)
    llm.max_model_len = 4096  # 256 pages a sequence, 1024 wanted for 4: the free memory bounds the pages
    itemsize = llm.model.dtype.itemsize
    page = 16 * cache_bytes_per_token(config, itemsize)
    state = 4 * kda_state_bytes_per_rank(config, 1, itemsize)
    scratch = verify_graph_tokens(4, 2048, 4) * verify_scratch_bytes_per_token(config, 1, itemsize)
    free = state + scratch + 600 * page
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    llm.device = torch.device("cuda")  # only the free-memory branch runs; nothing is allocated
    plain = llm._default_num_pages(16, 4, "auto", 1.0, 2048, 0)
    graphed = llm._default_num_pages(16, 4, "auto", 1.0, 2048, 4)
    assert graphed == 600 and plain == (scratch + 600 * page) // page > graphed


def test_graph_draft_tokens_resolution():
    """None follows the speculative config's k (clipped to a graph's 8 and to a page); an explicit value wins;
    without either there are no verify graphs."""
    from kimi_helix import KimiK3Config, KimiK3ForCausalLM
    from kimi_helix.engine import LLM
    from kimi_helix.engine.arguments import graph_draft_tokens

    from ..modeling.conftest import tiny_kwargs

    assert graph_draft_tokens(None, None, 64) == 0
    assert graph_draft_tokens(None, 5, 64) == 5
    assert graph_draft_tokens(None, 12, 64) == 8 and graph_draft_tokens(None, 5, 4) == 3
    assert graph_draft_tokens(4, None, 64) == 4 and graph_draft_tokens(0, 5, 64) == 0
    for bad in (-1, 9, 2.0, True):
        with pytest.raises(ValueError, match="max_draft_tokens must"):
            graph_draft_tokens(bad, None, 64)
    with pytest.raises(ValueError, match="within a page of 4"):
        graph_draft_tokens(4, None, 4)
    with pytest.raises(ValueError, match="max_draft_tokens must"):  # LLM checks it on every device
        LLM(KimiK3ForCausalLM(KimiK3Config(**tiny_kwargs())), device="cpu", max_draft_tokens=9)


def test_verify_graph_tokens():
    assert verify_graph_tokens(64, 2048, 0) == 0
    assert verify_graph_tokens(64, 2048, 4) == 320
    assert verify_graph_tokens(8, 2048, 8) == 72
    assert verify_graph_tokens(256, 2048, 4) == VERIFY_GRAPH_MAX_TOKENS == 512
    assert verify_graph_tokens(64, 100, 4) == 100
    assert verify_graph_tokens(64, 2048, 4, cap=64) == 64


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"tp": 3}, r"tp \* cp = 3 \* 1"),
        ({"tp": 4, "cp": 16}, r"tp \* cp = 4 \* 16"),
        ({"tp": 0}, "tp must"),
        ({"cp": 1.5}, "cp must"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must"),
        ({"page_size": 0}, "page_size must"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must"),
        ({"max_model_len": 0}, "max_model_len must"),
        ({"max_num_seqs": 0}, "max_num_seqs must"),
        ({"dtype": torch.int8}, "dtype must"),
    ],
)
def test_bad_arguments_raise_naming_them(k48, kwargs, names):
    with pytest.raises(ValueError, match=names):
        plan_memory(k48, GPU, **kwargs)
    with pytest.raises(ValueError, match="gpu_memory_bytes: cannot read '141 gigs'"):
        plan_memory(k48, "141 gigs")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_kimi_linear_48b_on_141gb(capsys):
    code, out, err = run(capsys, "plan", "--preset", "kimi-linear-48b-a3b", "--gpu-mem", "141GB")
    assert code == 0, err
    for expected in (
        "tp=1 x cp=1 = 1 rank; bfloat16 weights",
        "126,900,000,000 B (118.2 GiB) usable",
        "weights / rank  98,245,363,456 B (91.5 GiB)",
        "free for cache  27,010,469,376 B",
        "8,064 B (7.9 KiB) per token",
        "43,417,600 B (41.4 MiB) per sequence per rank",
        "max tokens      1,971,136 cached tokens",
        "max sequences   3 at max_model_len=1,048,576",
    ):
        assert expected in out, expected


def test_cli_plan_helix_fp8_from_a_config_json(capsys, tmp_path):
    raw = {**PRESETS["kimi-linear-48b-a3b"], "model_type": "kimi_linear"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    code, out, err = run(
        capsys, "plan", "--model", str(tmp_path), "--gpu-mem", "141GiB", "--tp", "2", "--cp", "2",
        "--kv-cache-dtype", "fp8_e4m3", "--max-model-len", "131072",
    )  # fmt: skip
    assert code == 0, err
    assert "24,561,340,864 B" in out
    assert "4,060 B (4.0 KiB) per token; 2,030 B per token per rank" in out
    assert "10,854,400 B" in out
    assert "at max_model_len=131,072" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-mem", "80GB"], "gpu_memory_bytes=80,000,000,000 is too small"),
        (["--gpu-mem", "lots"], "--gpu-mem: cannot read 'lots'"),
        (["--gpu-mem", "141GB", "--tp", "3"], "tp * cp = 3 * 1"),
    ],
)
def test_cli_plan_bad_input_exits_2(capsys, argv, message):
    code, _, err = run(capsys, "plan", "--preset", "kimi-linear-48b-a3b", *argv)
    assert code == 2
    assert message in err


def test_cli_kv_cache_dtype_choices_match_the_planner():
    from kimi_helix.cli import _build_parser

    plan = _build_parser()._subparsers._group_actions[0].choices["plan"]
    action = next(a for a in plan._actions if a.dest == "kv_cache_dtype")
    assert tuple(action.choices) == KV_CACHE_DTYPES
