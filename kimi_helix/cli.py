"""The `kimi-helix` command: list presets, write a random-weight checkpoint, generate text, print a model's sizes,
plan a GPU's memory.

    kimi-helix presets
    kimi-helix init --preset tiny --out ckpt/
    kimi-helix generate --model ckpt/ --prompt "Hello"
    kimi-helix info --preset kimi-linear-48b-a3b
    kimi-helix plan --preset kimi-linear-48b-a3b --gpu-mem 141GB --tp 2 --cp 2
    kimi-helix eval --model kimi_helix --model_args pretrained=ckpt/ --tasks kimi_helix_next_line

Bad input (an unknown preset, a non-empty output folder, a folder with no checkpoint) prints one line on stderr and
exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# Only the standard library at import time: `--help` must not wait seconds for torch and transformers.
if TYPE_CHECKING:
    import torch

    from kimi_helix.engine.planner import MemoryPlan
    from kimi_helix.modeling.config import KimiK3Config

DTYPES = ("float32", "bfloat16", "float16")
# `--gpu-mem` without a unit is GiB; a bare number this large was meant as bytes and is refused.
MAX_BARE_GIB = 2**16

# A random model emits arbitrary bytes; escape the control characters so they cannot drive the terminal.
_ESCAPE_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}


class UsageError(Exception):
    """Bad user input: `main` prints the message on stderr and returns 2."""


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default `sys.argv[1:]`); return the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # lm-eval's CLI parses everything after `eval`
        from kimi_helix.evals.__main__ import main as eval_main

        return eval_main(argv[1:])
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage error or the help
        return int(exit_.code or 0)
    try:
        args.run(args)
    except UsageError as err:
        print(f"kimi-helix: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kimi-helix: interrupted", file=sys.stderr)
        return 130
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: ...)` after each option's help, except where there is no default to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kimi-helix",
        description="Kimi-K3-style hybrid (KDA + MLA + MoE) models.",
        formatter_class=_HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    preset_help = "a built-in configuration (list them with `kimi-helix presets`)"

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        return commands.add_parser(name, formatter_class=_HelpFormatter, **kwargs)

    p = command("presets", help="list the built-in model configurations")
    p.set_defaults(run=_cmd_presets)

    p = command("init", help="write a random-weight checkpoint and the byte tokenizer to a folder")
    p.add_argument("--preset", required=True, metavar="NAME", help=preset_help)
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="the folder to write")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype")
    p.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    p.set_defaults(run=_cmd_init)

    p = command(
        "generate",
        help="continue a prompt",
        description="Continue a prompt, printing the text as it is generated. With neither --model nor --preset, "
        "the shipped demo model (a small code model trained on the Python standard library) continues it.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint folder (config, weights, tokenizer)")
    source.add_argument("--preset", metavar="NAME", help="a random-weight model of this preset")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seeds sampling (and a preset's random weights)")
    p.add_argument("--dtype", choices=DTYPES, help="default: the checkpoint's dtype; float32 for a preset")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun, tp * cp processes)")
    p.add_argument("--cp", type=int, default=1, help="Helix context-parallel size: MLA cache pages split cp ways")
    p.add_argument("--page-size", type=int, default=64, help="cache page size of a tp * cp > 1 run (Helix's unit)")
    p.add_argument(
        "--speculative-method", choices=("dspark", "ngram"), help="speculative decoding (docs/speculative.md)"
    )
    p.add_argument("--speculative-model", type=Path, metavar="DIR", help="the DSpark drafter's folder")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts verified per step (k)")
    p.set_defaults(run=_cmd_generate)

    p = command("info", help="parameter counts, layer layout, cache and state sizes; loads no weights")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint folder (only config.json is read)")
    source.add_argument("--preset", metavar="NAME", help=preset_help)
    p.set_defaults(run=_cmd_info)

    p = command(
        "plan",
        help="split one GPU's memory into weights, activations and cache; loads no weights",
        description="Plan one rank's memory for serving on tp x cp GPUs of --gpu-mem each: weights (sharded over "
        "tp*cp), the activation reserve, and how many tokens and sequences the MLA pages and KDA states then hold.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint folder (only config.json is read)")
    source.add_argument("--preset", metavar="NAME", help=preset_help)
    p.add_argument(
        "--gpu-mem",
        required=True,
        metavar="SIZE",
        help="one GPU's memory: a bare number is GiB (141 = 141 GiB); or with a unit: 141G / 141GiB (GiB), 141GB "
        "(10^9 bytes), 512MiB, 80e9B (bytes)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel (Helix) size")
    # planner.KV_CACHE_DTYPES, spelt out: the engine is imported only when `plan` runs.
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto", help="MLA page dtype")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weight dtype")
    p.add_argument("--max-model-len", type=int, metavar="N", help="default: the config's model_max_length")
    p.add_argument("--page-size", type=int, default=64, help="tokens per cache page")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-draft-tokens", type=int, default=0, help="drafts per graphed verify group (0: none)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of --gpu-mem to use")
    p.set_defaults(run=_cmd_plan)

    # Listed for --help only: `main` hands `eval ...` to kimi_helix.evals before parsing.
    commands.add_parser("eval", help="lm-eval accuracy runs (lm-eval's flags, plus --gpqa-data FILE)", add_help=False)
    return parser


# ---------------------------------------------------------------- commands
def _cmd_presets(args: argparse.Namespace) -> None:
    from kimi_helix.presets import PRESETS, preset_parameters  # torch-free: the table needs no model

    rows = [("name", "layers", "hidden", "MLA heads", "experts", "params (total / active)")]
    for name, f in PRESETS.items():
        total, active = preset_parameters(name)
        n_kda = len(f["linear_attn_config"]["kda_layers"])
        rows.append(
            (
                name,
                f"{f['num_hidden_layers']} ({n_kda} KDA + {f['num_hidden_layers'] - n_kda} MLA)",
                str(f["hidden_size"]),
                str(f["num_attention_heads"]),
                f"{f['num_experts']} top-{f['num_experts_per_token']} +{f['num_shared_experts']} shared",
                f"{_count(total)} / {_count(active)}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _cmd_init(args: argparse.Namespace) -> None:
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"--out {out} is not empty; pass --force to write into it")
    config = _preset(args.preset)
    _check_seed(args.seed)
    import torch

    from kimi_helix.tokenizer import build_byte_tokenizer

    model = _random_model(config, args.seed, _dtype(args.dtype), torch.device("cpu"))
    model.save_pretrained(out, overwrite=args.force)
    build_byte_tokenizer().save_pretrained(out)
    print(f"wrote a random {args.preset} checkpoint ({args.dtype}, seed {args.seed}) and the byte tokenizer to {out}")


def _demo_model_with_notice():
    """The shipped demo model's directory, saying on stderr that it stands in for a missing --model."""
    from kimi_helix.assets import demo_model_dir

    print(
        "kimi-helix: no --model or --preset given; using the shipped demo model (9M parameters, trained on the "
        "Python standard library's sources: docs/demo-model.md)",
        file=sys.stderr,
    )
    return demo_model_dir()


def _cmd_generate(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0 (0 decodes greedily), got {args.temperature}")
    if not 0 < args.top_p <= 1:  # also refuses NaN
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    _check_seed(args.seed)
    _check_backend_variables()
    if args.tp < 1 or args.cp < 1 or args.page_size < 1:
        raise UsageError(f"--tp, --cp and --page-size must be >= 1, got {args.tp}, {args.cp}, {args.page_size}")
    if args.tp * args.cp > 1:
        return _generate_parallel(args)
    if args.speculative_method is not None:
        return _generate_speculative(args)
    import torch

    from kimi_helix.kernels.backends import BackendUnavailableError
    from kimi_helix.tokenizer import build_byte_tokenizer

    device = _device(args.device)
    dtype = _dtype(args.dtype) if args.dtype else None
    # Config and tokenizer first: a prompt that cannot fit is refused before any weights are read.
    if args.model is None and args.preset is None:
        args.model = _demo_model_with_notice()
    if args.model is not None:
        config, tokenizer = _read_config(args.model), _checkpoint_tokenizer(args.model)
    else:
        config, tokenizer = _preset(args.preset), build_byte_tokenizer()
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    if input_ids.shape[1] == 0:
        raise UsageError("--prompt must not be empty")
    limit = config.model_max_length
    if input_ids.shape[1] + args.max_new_tokens > limit:
        raise UsageError(
            f"--prompt ({input_ids.shape[1]} tokens) + --max-new-tokens ({args.max_new_tokens}) = "
            f"{input_ids.shape[1] + args.max_new_tokens} exceeds the model's model_max_length={limit}"
        )
    if args.model is not None:
        model = _load_weights(args.model, dtype, device)
    else:
        model = _random_model(config, args.seed, dtype or torch.float32, device)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    torch.manual_seed(args.seed)  # sampling draws from the global generator
    try:
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=args.max_new_tokens,
            streamer=_terminal_streamer(tokenizer),
            **(sampling if args.temperature > 0 else {"do_sample": False}),
        )
    except BackendUnavailableError as err:
        raise UsageError(f"{err} (check KIMI_HELIX_KERNEL_BACKEND / KIMI_HELIX_ATTENTION_BACKEND)") from err


def _cmd_info(args: argparse.Namespace) -> None:
    from kimi_helix.modeling.accounting import (
        count_parameters,
        kda_state_bytes_per_sequence,
        layer_pattern,
        mla_cache_bytes_per_token,
        n_kda_layers,
    )

    config, source = _config_from_args(args)
    total, active = count_parameters(config)
    n_layers, n_kda = config.num_hidden_layers, n_kda_layers(config)
    n_moe = sum(config.is_moe_layer(i) for i in range(n_layers))
    h, k = config.kda_num_heads, config.kda_head_dim
    pattern = layer_pattern(config).replace("\n", "\n" + " " * 13)
    print(f"model        {source}")
    print(f"parameters   {_count(total)} total ({total:,}), {_count(active)} active per token ({active:,})")
    print(
        f"layers       {n_layers} = {n_kda} KDA + {n_layers - n_kda} MLA; {n_layers - n_moe} dense MLP + {n_moe} MoE "
        f"({config.num_experts} experts, top-{config.num_experts_per_token}, {config.num_shared_experts} shared)"
    )
    print(f"pattern      {pattern}")
    print(
        f"MLA cache    {_bytes(mla_cache_bytes_per_token(config))} per token "
        f"(bf16 latent {config.kv_lora_rank} + rope key {config.qk_rope_head_dim} per MLA layer)"
    )
    print(
        f"KDA state    {_bytes(kda_state_bytes_per_sequence(config))} per sequence "
        f"(fp32 state {h}x{k}x{k} + bf16 conv {3 * h * k}x{config.conv_kernel_size - 1} per KDA layer)"
    )


def _cmd_plan(args: argparse.Namespace) -> None:
    gpu_mem = _gpu_mem(args.gpu_mem)
    config, source = _config_from_args(args)
    from kimi_helix.engine.planner import plan_memory

    try:
        plan = plan_memory(
            config,
            gpu_mem,
            tp=args.tp,
            cp=args.cp,
            kv_cache_dtype=args.kv_cache_dtype,
            dtype=_dtype(args.dtype),
            page_size=args.page_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_draft_tokens=args.max_draft_tokens,
        )
    except ValueError as err:
        raise UsageError(str(err)) from err
    print(_plan_table(plan, source))


def _plan_table(plan: MemoryPlan, source: str) -> str:
    """`plan` as two columns: a name, then bytes with their binary-unit size, then what they cover."""
    dtype = str(plan.dtype).removeprefix("torch.")
    kv = "fp8 e4m3 (+ fp32 per-token scales)" if plan.kv_cache_dtype == "fp8_e4m3" else dtype
    ranks = f"tp={plan.tp} x cp={plan.cp} = {plan.world_size} rank{'s' * (plan.world_size > 1)}"
    per_rank = plan.mla_cache_bytes_per_token_per_rank
    rows = [
        ("model", source),
        ("layout", f"{ranks}; {dtype} weights; KV cache in {kv}; pages of {plan.page_size} tokens"),
        (
            "GPU memory",
            f"{_bytes(plan.gpu_memory_bytes)} x {plan.gpu_memory_utilization:g} = {_bytes(plan.usable_bytes)} usable",
        ),
        ("weights / rank", _bytes(plan.weight_bytes_per_rank)),
    ]
    if plan.draft_weight_bytes:
        rows.append(("  of which draft", _bytes(plan.draft_weight_bytes)))
    rows += [
        (
            "activations",
            f"{_bytes(plan.activation_reserve_bytes)} (reserve: max_num_batched_tokens={plan.max_num_batched_tokens}, "
            f"max_num_seqs={plan.max_num_seqs})",
        ),
    ]
    if plan.verify_scratch_bytes:
        rows.append(
            ("verify scratch", f"{_bytes(plan.verify_scratch_bytes)} (graphed verify steps, k={plan.max_draft_tokens})")
        )
    rows += [
        ("free for cache", _bytes(plan.free_bytes_for_cache)),
        (
            "MLA cache",
            f"{_bytes(plan.mla_cache_bytes_per_token)} per token; {per_rank:,.{0 if per_rank.is_integer() else 1}f} B "
            f"per token per rank (page b on rank b % cp)",
        ),
        ("KDA state", f"{_bytes(plan.kda_state_bytes_per_sequence_per_rank)} per sequence per rank"),
        (
            "pages / rank",
            f"{plan.num_pages_per_rank:,} of {_bytes(plan.page_bytes)}, after KDA state for max_num_seqs="
            f"{plan.max_num_seqs}",
        ),
        ("max tokens", f"{plan.max_concurrent_tokens:,} cached tokens at once, over all sequences"),
        (
            "max sequences",
            f"{plan.max_concurrent_sequences:,} at max_model_len={plan.max_model_len:,} "
            f"({_bytes(plan.mla_cache_bytes_per_sequence_per_rank + plan.kda_state_bytes_per_sequence_per_rank)} "
            f"each on the fullest rank)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


# ---------------------------------------------------------------- helpers
def _preset(name: str) -> KimiK3Config:
    from kimi_helix.presets import PRESETS, get_preset

    if name not in PRESETS:
        raise UsageError(f"--preset {name!r} is not a preset; choose from {', '.join(PRESETS)}")
    return get_preset(name)


def _config_from_args(args: argparse.Namespace) -> tuple[KimiK3Config, str]:
    """The config named by `--model DIR` (its config.json only) or `--preset NAME`, and a line saying which."""
    if args.model is not None:
        return _read_config(args.model), f"{args.model} (config.json)"
    return _preset(args.preset), f"{args.preset} (preset)"


def _read_config(path: Path) -> KimiK3Config:
    """`path/config.json`, read and checked exactly as `from_pretrained` reads it (no weights are touched)."""
    from kimi_helix.modeling.checkpoint import read_config as read_checkpoint_config

    if not (path / "config.json").is_file():
        raise UsageError(f"--model {path}: no config.json there")
    try:
        return read_checkpoint_config(path)
    except ValueError as err:  # CheckpointError, the config's own field errors, bad JSON
        raise UsageError(f"--model {path}: {err}") from err


def _checkpoint_tokenizer(path: Path):
    """The tokenizer in the folder `path`, loaded without running any code from it."""
    from kimi_helix.tokenizer import TokenizerLoadError, load_tokenizer

    try:
        return load_tokenizer(path)
    except TokenizerLoadError as err:
        raise UsageError(f"--model {path}: {err}") from err


def _load_weights(path: Path, dtype: torch.dtype | None, device: torch.device) -> torch.nn.Module:
    """The model in the folder `path`; every way its weights can be wrong is one `UsageError` line."""
    from safetensors import SafetensorError

    from kimi_helix.modeling.model import KimiK3ForCausalLM

    try:
        return KimiK3ForCausalLM.from_pretrained(path, dtype=dtype, device=device).eval()
    except (ValueError, OSError, SafetensorError) as err:  # CheckpointError is a ValueError
        raise UsageError(f"--model {path}: {err}") from err


def _random_model(config: KimiK3Config, seed: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A randomly initialised model in `dtype` on `device`; one that cannot fit in that device's memory is refused
    before anything is allocated."""
    import torch

    from kimi_helix.modeling.accounting import count_parameters
    from kimi_helix.modeling.model import KimiK3ForCausalLM

    total, _ = count_parameters(config)
    need = total * dtype.itemsize
    have = _memory_bytes(device)
    if need > have:
        raise UsageError(
            f"{_count(total)} parameters in {str(dtype).removeprefix('torch.')} need {_bytes(need)}, more than the "
            f"{_bytes(have)} of {device.type} memory here"
        )
    torch.manual_seed(seed)
    with device:  # initialise in place: a model that fits on the GPU need not fit in host memory too
        return KimiK3ForCausalLM._from_config(config, dtype=dtype).eval()


def _generate_parallel(args: argparse.Namespace) -> None:
    """`generate --tp T --cp C`: one process per rank of a torchrun launch; rank 0 prints the continuation."""
    if int(os.environ.get("WORLD_SIZE", "1")) != args.tp * args.cp:
        raise UsageError(
            f"--tp {args.tp} --cp {args.cp} runs {args.tp * args.cp} processes: launch it with "
            f"torchrun --nproc-per-node {args.tp * args.cp} -m kimi_helix generate ..."
        )
    if args.preset is not None or args.top_p < 1:
        raise UsageError("--tp/--cp take a checkpoint (--model DIR, or the demo model without it) and no --top-p")
    from kimi_helix.parallel.launch import generate_parallel

    args.model = args.model or _demo_model_with_notice()

    text, _ = generate_parallel(args)
    if text is not None:
        print(text.translate(_ESCAPE_CONTROLS))


def _generate_speculative(args: argparse.Namespace) -> None:
    """`generate --speculative-method M`: the engine with speculative decoding; the validator runs before any
    weights load, and an unsupported configuration prints every reason on one line."""
    if args.preset is not None or args.top_p < 1:
        raise UsageError("--speculative-method takes a checkpoint (--model DIR, or the demo model) and no --top-p")
    from kimi_helix.engine import LLM, SamplingParams
    from kimi_helix.speculative.validator import UnsupportedConfigError

    spec = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.speculative_model is not None:
        spec["model"] = str(args.speculative_model)
    model = args.model or _demo_model_with_notice()
    try:
        llm = LLM(model, dtype=_dtype(args.dtype) if args.dtype else None, device=args.device,
                  speculative_config=spec)  # fmt: skip
    except UnsupportedConfigError as err:
        raise UsageError(" ".join(str(err).split())) from err
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    print(out.text.translate(_ESCAPE_CONTROLS))


def _terminal_streamer(tokenizer):
    """A transformers `TextStreamer` that prints the new text as it is generated, control characters escaped."""
    from transformers import TextStreamer

    class EscapingStreamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            print(text.translate(_ESCAPE_CONTROLS), flush=True, end="\n" if stream_end else "")

    return EscapingStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _memory_bytes(device: torch.device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 2**64:  # torch.manual_seed's range
        raise UsageError(f"--seed must be in [0, 2**64), got {seed}")


def _check_backend_variables() -> None:
    """Refuse an unknown backend name in the environment before any model is built."""
    from kimi_helix.kernels.backends import ATTENTION_ENV_VAR, KERNEL_ENV_VAR, backend_names

    for var, kind in ((ATTENTION_ENV_VAR, "attention"), (KERNEL_ENV_VAR, "kernels")):
        value, names = os.environ.get(var), backend_names(kind)
        if value and value not in names:
            raise UsageError(f"{var}={value!r} is not a backend; use one of {', '.join(names)} or unset it")


def _gpu_mem(value: str) -> int:
    """`--gpu-mem` in bytes: a bare number is GiB; a unit is read by `planner.parse_bytes`."""
    from kimi_helix.engine.planner import parse_bytes

    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None and math.isfinite(number) and number >= MAX_BARE_GIB:
        raise UsageError(
            f"--gpu-mem: a number without a unit is GiB, and {value} GiB is not a GPU; write {value}B for "
            "bytes or add a unit (141GB, 141GiB)"
        )
    try:
        return parse_bytes(value, bare_unit="GiB")
    except ValueError as err:
        raise UsageError(f"--gpu-mem: {err}") from err


def _device(name: str | None) -> torch.device:
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UsageError(f"--device {name!r} is not a device (try cpu, cuda, cuda:1)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: only cpu and cuda are supported")
    return device


def _count(n: int) -> str:
    """49122681728 -> '49.12B'."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    """8064 -> '8,064 B (7.9 KiB)'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.1f} {unit})"
    return f"{n:,} B"
