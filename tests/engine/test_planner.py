import json

import pytest
import torch

from kimi_helix.cli import main
from kimi_helix.engine.planner import KV_CACHE_DTYPES, parse_bytes, plan_memory
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
