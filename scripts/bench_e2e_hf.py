"""transformers' native `KimiLinearForCausalLM` decoding at a preset's shapes: the baseline of `bench_e2e.py`.

    python scripts/bench_e2e_hf.py --layers 27 --batches 1,8 --contexts 4096    # alone, on the GPU
    python scripts/bench_e2e_hf.py --device cpu --preset tiny --layers 2        # CPU smoke run

`bench_e2e.py` imports `bench_hf` and runs it in the same call, before building its own model (the two 48B
models do not fit on one GPU together); the shape helpers both scripts share (`truncated_config`, the floor's
bytes) live here for that reason.

- **Build, no CPU work.** The model is constructed on the meta device (no storage, no initialisation), cast,
  given uninitialised storage on the target device (`to_empty`) and initialised there by the model's own
  `_init_weights` (normal and uniform fills on the device). `build_s` records it.
- **No prefill.** Its prefill of a long prompt (per-head expanded MLA keys, fla's chunked KDA with its autotuning)
  is not what is compared, and costs minutes of device time at full size. Instead a `DynamicCache(config=...)`
  is filled at the context length through the Cache methods the model's own prefill calls: per MLA layer
  `update(latent, rope_key, layer)` with random [B, 1, context, kv_lora_rank] and [B, 1, context, rope]
  tensors (the compressed KV the layer caches), per KDA layer `update_conv_state` with a random
  [B, 3 H K, W] window and `update_recurrent_state` with a random fp32 [B, H, K, K] state. The decode steps
  that follow take the path they take after a real prefill (single-token conv update and fused recurrent KDA)
  and read the same bytes; `prefill_s` records the fill. tests/scripts/test_bench_e2e.py checks, on the CPU,
  that a cache filled this way with a real prefill's tensors gives the real prefill's next-token logits.
- **Timed.** `WARMUP_STEPS` greedy decode steps (`warmup_s`: fla's kernels compile here), then `steps` timed ones
  (wall clock, synchronised), then one profiled step (kernels per step) and one hooked step (routed experts
  touched, for the floor). transformers 5.17 takes the cache as `past_key_values=`, later versions as `cache=`:
  the keyword is read from the forward's signature.

The floor is `bench_e2e.py`'s: the weight bytes the step reads (only the routed experts it touched, only the
batch's embedding rows) plus `step_cache_bytes`, over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import (  # noqa: E402
    JsonlWriter,
    copy_tbps,
    int_list,
    print_markdown_table,
    profile_kernels,
    release,
    run_metadata,
    sync,
)

from kimi_helix.engine.planner import (  # noqa: E402
    cache_bytes_per_token,
    kda_state_bytes_per_rank,
    verify_scratch_bytes_per_token,
)
from kimi_helix.presets import PRESETS, get_preset  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "e2e.jsonl"
WARMUP_STEPS = 3
# kimi-helix config names -> transformers' KimiLinearConfig names
HF_NAMES = dict(num_experts="num_local_experts", num_experts_per_token="num_experts_per_tok",
                num_shared_experts="n_shared_experts", num_expert_group="n_group")  # fmt: skip


# ---------------------------------------------------------------- shapes and the floor (shared with bench_e2e)
def truncated_config(preset: str, layers: int | None):
    """The preset's kimi-helix config with only its first `layers` layers (all when None)."""
    config = get_preset(preset)
    if layers is None or layers == config.num_hidden_layers:
        return config
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {config.num_hidden_layers}], got {layers}")
    lac = _truncated_lac(config.linear_attn_config, layers)
    return type(config)(**{**config.to_dict(), "num_hidden_layers": layers, "linear_attn_config": lac})


def _truncated_lac(lac: dict, layers: int) -> dict:
    """`linear_attn_config` of the first `layers` layers (its layer lists are 1-based)."""
    lac = dict(lac)
    lac["kda_layers"] = [i for i in lac["kda_layers"] if i <= layers]
    lac["full_attn_layers"] = [i for i in lac["full_attn_layers"] if i <= layers]
    return lac


def step_cache_bytes(config, batch: int, context: int, new_tokens: int, dtype_bytes: int, kv_cache_dtype="auto"):
    """Bytes of cache and state a step of `new_tokens` tokens a sequence moves, `batch` sequences at `context`
    cached tokens: the MLA latents of the context read and the new tokens' read and written, every KDA recurrent
    and conv state read and written, and for a verify step (new_tokens > 1) the per-token KDA scratch its rollback
    needs, written (`planner.verify_scratch_bytes_per_token`). Sizes from the planner, as the engine's."""
    mla = batch * (context + 2 * new_tokens) * cache_bytes_per_token(config, dtype_bytes, kv_cache_dtype)
    kda = 2 * batch * kda_state_bytes_per_rank(config, 1, dtype_bytes)
    verify = batch * new_tokens * verify_scratch_bytes_per_token(config, 1, dtype_bytes) if new_tokens > 1 else 0
    return mla + kda + verify


def weight_bytes(model: torch.nn.Module, embedding: torch.nn.Module, experts: tuple, batch: int, touched) -> int:
    """Bytes of weights one decode step reads: every parameter once, but only `batch` rows of `embedding` and,
    per routed-experts module (an instance of `experts`, whose parameters are [E, ...]), only the experts that
    layer touched (`touched`, in layer order)."""
    total, layer = 0, 0
    for module in model.modules():
        routed = isinstance(module, experts)
        for p in module.parameters(recurse=False):
            nbytes = p.numel() * p.element_size()
            if module is embedding:
                nbytes = batch * p.shape[1] * p.element_size()
            elif routed:
                nbytes = nbytes // p.shape[0] * touched[layer]
            total += nbytes
        layer += routed
    return total


def experts_touched(model: torch.nn.Module, router_type: type, index_of, step) -> list[int]:
    """Distinct routed experts each MoE layer reads in one call of `step`: hooks on every `router_type` module,
    whose output's `index_of(output)` holds the chosen expert ids."""
    counts: list[int] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: counts.append(int(index_of(out).unique().numel())))
        for m in model.modules()
        if isinstance(m, router_type)
    ]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return counts


def sig(x: float) -> float:
    """x to 4 significant digits (tiny CPU shapes give floors of microseconds)."""
    return float(f"{x:.4g}")


# ---------------------------------------------------------------- the model and its cache
def hf_modeling():
    from transformers.models.kimi_linear import modeling_kimi_linear

    return modeling_kimi_linear


def hf_config(preset: str, layers: int | None):
    """transformers' `KimiLinearConfig` at the preset's shapes, first `layers` layers."""
    kw = copy.deepcopy(PRESETS[preset])
    lac = kw.pop("linear_attn_config")
    if layers is not None:
        kw["num_hidden_layers"] = layers
        lac = _truncated_lac(lac, layers)
    kw = {HF_NAMES.get(k, k): v for k, v in kw.items()}
    return hf_modeling().KimiLinearConfig(linear_attn_config=lac, **kw)


@torch.no_grad()
def build_hf_model(preset: str, layers: int | None, dtype: torch.dtype, device: torch.device):
    """transformers' `KimiLinearForCausalLM`, random weights, built without touching the CPU (module docstring)."""
    config = hf_config(preset, layers)
    with torch.device("meta"):
        model = hf_modeling().KimiLinearForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)  # the dtype first: fp32 storage would not fit at full size
    model.apply(model._init_weights)
    return model.eval()


def kda_backend() -> str:
    """The KDA kernels transformers resolved when its modeling module was imported: "fla", or "torch" (its
    reference implementation)."""
    fn = hf_modeling().recurrent_kimi_delta_attention
    try:
        return "fla" if inspect.getclosurevars(fn).nonlocals["is_new_implementation"] else "torch"
    except (KeyError, TypeError):  # another transformers layout: ask whether fla imports at all
        import importlib.util

        return "fla" if importlib.util.find_spec("fla") is not None else "torch"


def random_state(kind: str, layer: int, shape: tuple, dtype: torch.dtype, device, g: torch.Generator):
    """The default filler of `fill_hf_cache`: unit normal latents, small normal KDA states (as a prompt leaves
    them: bounded, not zero)."""
    scale = 1.0 if kind in ("latent", "rope") else 0.1
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)


@torch.no_grad()
def fill_hf_cache(model, batch: int, context: int, seed: int = 0, make=random_state):
    """A `DynamicCache` holding `batch` sequences at `context` cached tokens, filled without a prefill through the
    Cache methods the model's prefill calls (module docstring). `make(kind, layer, shape, dtype, device, g)`
    gives each tensor: kind "latent" [B, 1, T, kv_lora_rank] and "rope" [B, 1, T, rope] per MLA layer, "conv"
    [B, 3 H K, W] and "recurrent" [B, H, K, K] fp32 per KDA layer."""
    from transformers.cache_utils import DynamicCache

    config, device, dtype = model.config, model.device, model.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    # Later transformers versions (5.25) count the cache's length from the KDA layers' conv updates, so the filled
    # cache reports W tokens rather than `context`: harmless, KimiLinear's MLA has no positional encoding and a
    # one-token step's mask covers every cached key (the CPU test checks the logits on 5.17 and 5.25).
    cache = DynamicCache(config=config)
    h, k, w = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    for i, kind in enumerate(config.layer_types):
        if kind == "full_attention":
            latent = make("latent", i, (batch, 1, context, config.kv_lora_rank), dtype, device, g)
            rope = make("rope", i, (batch, 1, context, config.qk_rope_head_dim), dtype, device, g)
            cache.update(latent, rope, i)
        else:
            cache.update_conv_state(make("conv", i, (batch, 3 * h * k, w), dtype, device, g), i, conv_kernel_size=w)
            cache.update_recurrent_state(make("recurrent", i, (batch, h, k, k), torch.float32, device, g), i)
    return cache


def cache_keyword(model) -> str:
    """The forward's name for the cache: `past_key_values` (transformers 5.17) or `cache` (later)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# ---------------------------------------------------------------- the benchmark
@torch.no_grad()
def bench_hf_case(model, config, batch: int, context: int, steps: int, bandwidth: float, device) -> dict:
    """One decode case of transformers' model: fill, warm up, time, profile; its row (without run metadata).
    `config` is the kimi-helix config of the same shapes (for the floor); `bandwidth` in GB/s."""
    start = time.perf_counter()
    cache = fill_hf_cache(model, batch, context, seed=batch)
    sync(device)
    prefill_s = time.perf_counter() - start
    kw = {cache_keyword(model): cache}
    vocab = model.config.vocab_size
    token = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(batch)).to(device)

    def step() -> None:
        nonlocal token
        token = model(input_ids=token, use_cache=True, **kw).logits[:, -1:].argmax(-1)

    t = time.perf_counter()
    for _ in range(WARMUP_STEPS):
        step()
    sync(device)
    warmup_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    ms = (time.perf_counter() - t) * 1e3 / steps
    kernels, _ = profile_kernels(step, device, 1)
    hf = hf_modeling()
    touched = experts_touched(model, hf.KimiLinearTopkRouter, lambda out: out[2], step)
    experts = (hf.KimiLinearExperts,)
    nbytes = weight_bytes(model, model.model.embed_tokens, experts, batch, touched)
    nbytes += step_cache_bytes(config, batch, context, 1, model.dtype.itemsize)
    floor_ms = 1e3 * nbytes / (bandwidth * 1e9)
    return dict(
        ms_per_step=round(ms, 3),
        tokens_per_s=round(batch * 1e3 / ms, 1),
        kernels_per_step=kernels,
        floor_ms=sig(floor_ms),
        floor_gb=round(nbytes / 1e9, 3),
        pct_of_floor=sig(100 * floor_ms / ms),
        experts_touched_mean=round(sum(touched) / max(len(touched), 1), 1),
        prefill_s=round(prefill_s, 2),
        warmup_s=round(warmup_s, 2),
    )


def bench_hf(preset: str, layers: int | None, dtype, device, shapes, steps: int, bandwidth: float, budget=None):
    """Yields transformers' row at each (batch, context) of `shapes`, in order, each with its `case_s`; the first
    also has `build_s` (the model is built once). A shape that raises gets a row with the exception's text under
    `failed`; a shape that `budget.skip_reason("hf")` refuses (a `bench_e2e.Budget`) a `skipped` row. Rows come
    as they finish (a run killed part way keeps them); the model is freed at the end."""
    import transformers

    config = truncated_config(preset, layers)
    base = dict(case="decode", phase="decode", mode="transformers", layers=config.num_hidden_layers)
    base |= dict(ms_per_step=None, kernels_per_step=None, floor_ms=None, pct_of_floor=None)
    base["transformers"] = transformers.__version__
    start = time.perf_counter()
    try:
        model = build_hf_model(preset, layers, dtype, device)
    except Exception as err:  # noqa: BLE001 - a row says why; the engine's cases still run
        release(device)
        for b, c in shapes:
            yield dict(base, batch=b, context=c, failed=_error(err))
        return
    sync(device)
    build_s = round(time.perf_counter() - start, 2)
    base["mode"] = f"transformers+{kda_backend()}"
    for i, (batch, context) in enumerate(shapes):
        row = dict(base, batch=batch, context=context)
        why = budget.skip_reason("hf") if budget is not None else None
        if why is not None:
            yield dict(row, skipped=why)
            continue
        start = time.perf_counter()
        try:
            row.update(bench_hf_case(model, config, batch, context, steps, bandwidth, device))
        except Exception as err:  # noqa: BLE001 - out of memory or a transformers change: recorded, not fatal
            row["failed"] = _error(err)
        release(device)
        row["case_s"] = round(time.perf_counter() - start, 2)
        if budget is not None:
            budget.record("hf", row["case_s"])
        if i == 0:
            row["build_s"] = build_s
        yield row
    del model
    release(device)


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="kimi-linear-48b-a3b")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batches", type=int_list, default=[1, 8])
    p.add_argument("--contexts", type=int_list, default=[4096])
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per case")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSONL results (default: {DEFAULT_OUT})")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    bandwidth = copy_tbps(device, gib=1 if device.type == "cuda" else 1 / 64) * 1e3  # GB/s
    meta = {**run_metadata(), "preset": args.preset, "dtype": str(dtype).removeprefix("torch."),
            "copy_gbps": round(bandwidth, 1)}  # fmt: skip
    shapes = [(b, c) for c in args.contexts for b in args.batches]
    with JsonlWriter(args.out) as results:
        for row in bench_hf(args.preset, args.layers, dtype, device, shapes, args.steps, bandwidth):
            results.write({**meta, **row})
    rows = results.records
    cols = ["mode", "layers", "batch", "context", "ms_per_step", "tokens_per_s", "kernels_per_step", "floor_ms",
            "pct_of_floor", "build_s", "prefill_s", "warmup_s", "case_s", "failed", "skipped"]  # fmt: skip
    print_markdown_table(rows, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
