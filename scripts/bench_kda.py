"""Benchmark the Triton KDA kernels: chunked prefill (against fla's chunk_kda) and fused recurrent decode (against
the state-traffic floor).

    python scripts/bench_kda.py                                  # both phases, the full grids (H200: a few minutes)
    python scripts/bench_kda.py --phase prefill --T 8192 --H 64  # one prefill case (the target: <= 1.2 ms on an H200)
    python scripts/bench_kda.py --phase prefill --breakdown      # also the time of each kernel (torch.profiler)
    python scripts/bench_kda.py --phase prefill --chunk-size 32  # our kernels at 32-token chunks (fla keeps 64)
    python scripts/bench_kda.py --phase decode --tokens 1 4      # decode and verify (k + 1 = 4 tokens per sequence)
    python scripts/bench_kda.py --phase decode --sweep           # also the (BV, num_warps) sweep, to retune _config
    python scripts/bench_kda.py --smoke                          # tiny shapes (CPU: the Triton interpreter)

Prefill: B=1, T in {2048, 8192, 16384}, H in {32, 64, 96}, K=V=128; bf16 q, k, v, beta and an fp32 log-decay g,
with the L2 norm of q and k in the kernel and the final state returned, as the model calls it. Backends ``triton``
(g given), ``triton_gate`` (raw gate pre-activation with A_log/dt_bias and lower_bound -5, the K3 path) and
``fla`` (when importable). ``tflops`` counts the chunked algorithm's matmuls with C = 64 per token and head, dense
(causal halves included): 2 (3 C K + 2 C V + 3 K V). Rows go to <out>/kda_prefill.jsonl.

Decode: N in {1, 64, 256} sequences, H=32, K=V=128 (`--decode-heads`, `--decode-dim`: the demo model's are 4,
64). A step reads and writes every sequence's fp32 state [H, K, V] once, 2 N H K V 4 bytes, while q, k, v, the gate
and o are a few hundred times smaller; TB/s counts that state traffic and ``floor_ms`` is it over a >= 1 GiB
device-to-device copy (read + write) timed in the same run. States live in a pool with scattered slots updated in
place, the gate computed in the kernel from bf16 pre-activations, as the engine calls it.
Rows go to <out>/kda_decode.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton's decorators run
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when this file is loaded by path
from bench_common import JsonlWriter, bench_ms, copy_tbps, run_metadata  # noqa: E402

from kimi_helix.kernels.kda import chunk as kda_chunk  # noqa: E402
from kimi_helix.kernels.kda import fused_recurrent as fr  # noqa: E402
from kimi_helix.kernels.kda.chunk import chunk_kda_triton  # noqa: E402
from kimi_helix.kernels.kda.naive import kda_gate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SWEEP = [(bv, nw) for bv in (16, 32, 64) for nw in (1, 2, 4, 8)]  # decode (BV, num_warps)


def prefill_flops(T: int, H: int, K: int, V: int, C: int = 64) -> float:
    return 2.0 * T * H * (3 * C * K + 2 * C * V + 3 * K * V)


def _fla_kda():
    try:
        from fla.ops import kda
    except ImportError:
        return None
    return kda


def kernel_breakdown(fn, reps: int = 5) -> dict[str, float]:
    """Microseconds per call of each GPU kernel that fn launches, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us > 0:
            times[evt.key[:80]] += us / reps
    return {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])}


def prefill_inputs(T: int, H: int, D: int, dtype, device) -> dict:
    """Seeded prefill inputs, B=1: q, k, v, f (the raw gate) and beta in `dtype`, fp32 A_log and dt_bias, and the
    fp32 log-decay g = kda_gate(f, A_log, dt_bias)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    x = dict(q=rnd(1, T, H, D), k=rnd(1, T, H, D), v=rnd(1, T, H, D), f=rnd(1, T, H, D))
    x["beta"] = torch.sigmoid(rnd(1, T, H))
    x["A_log"], x["dt_bias"] = rnd(H, dt=torch.float32) * 0.5, rnd(H * D, dt=torch.float32) * 0.5 - 1.0
    x["g"] = kda_gate(x["f"], x["A_log"], x["dt_bias"])
    return x


def prefill_case(T: int, H: int, D: int, dtype, device, chunk_size: int, breakdown: bool):
    """Yields one row per backend, each as soon as it is timed."""
    x = prefill_inputs(T, H, D, dtype, device)
    q, k, v, f, beta, A_log, dt_bias, g = (x[n] for n in ("q", "k", "v", "f", "beta", "A_log", "dt_bias", "g"))
    common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    backends = {
        "triton": lambda: chunk_kda_triton(q, k, v, g, beta, chunk_size=chunk_size, **common),
        "triton_gate": lambda: chunk_kda_triton(
            q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, chunk_size=chunk_size, **common
        ),
    }
    fla = _fla_kda()
    if fla is not None and device.type == "cuda":
        backends["fla"] = lambda: fla.chunk_kda(q, k, v, g, beta, **common)
    for name, fn in backends.items():
        ms = bench_ms(fn, device, cpu_reps=2)
        row = dict(phase="prefill", T=T, H=H, K=D, V=D, dtype=str(dtype).removeprefix("torch."), backend=name, ms=ms)
        if name.startswith("triton"):  # the chunk size and launch tables the row was measured with
            row["chunk_size"] = chunk_size
            intra = "INTRA" if name == "triton" else "INTRA_BOUNDED"
            tables = (intra, "HALVES", "BLOCKS", "WY", "STATE", "OUTPUT")
            row["launch"] = {t: dict(getattr(kda_chunk, t)) for t in tables}
        row["tflops"] = prefill_flops(T, H, D, D) / ms / 1e9
        if breakdown and device.type == "cuda":
            row["kernels_us"] = kernel_breakdown(fn)
        yield row


@contextlib.contextmanager
def forced_config(config: tuple[int, int] | None):
    """Run the decode kernel with a fixed (BV, num_warps) instead of the choice of fused_recurrent._config (its
    tokens loaded at a time, BT, stay its choice)."""
    chosen = fr._config
    if config is not None:
        fr._config = lambda N, H, K, V, tokens: (*config, chosen(N, H, K, V, tokens)[2])
    try:
        yield
    finally:
        fr._config = chosen


def decode_case(n: int, h: int, d: int, t: int, dtype, device) -> dict:
    """Time one decode (t = 1) or verify (t > 1) step of n sequences over a pool of 2n slots."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    q, k, v, f = rnd(n, t, h, d), rnd(n, t, h, d), rnd(n, t, h, d), rnd(n, t, h, d)
    beta = torch.sigmoid(rnd(n, t, h))
    A_log, dt_bias = rnd(h, dt=torch.float32) * 0.5, rnd(h * d, dt=torch.float32) * 0.5 - 1.0
    pool = rnd(2 * n, h, d, d, dt=torch.float32) * 0.1
    slots = torch.randperm(2 * n, generator=gen, device=device)[:n]

    def step():
        fr.fused_recurrent_kda_triton(
            q, k, v, f, beta, initial_state=pool, state_indices=slots, output_final_state=True,
            use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        )  # fmt: skip

    ms = bench_ms(step, device)
    bv, num_warps, bt = fr._config(n, h, d, d, t)
    return dict(
        phase="decode", n=n, h=h, k=d, v=d, t=t, dtype=str(dtype).removeprefix("torch."), bv=bv,
        num_warps=num_warps, bt=bt, ms=ms, tbps=2 * n * h * d * d * 4 / ms / 1e9,
    )  # fmt: skip


def run_prefill(args, device, meta) -> list[dict]:
    if args.smoke:  # the interpreter garbles bf16, so the CPU smoke run uses fp16
        cases, dtype, D, chunk_size = [(40, 2)], torch.float16, 16, 16
    else:
        cases, dtype, D, chunk_size = [(t, h) for t in args.T for h in args.H], torch.bfloat16, 128, args.chunk_size
    with JsonlWriter(args.out / "kda_prefill.jsonl") as out:
        for T, H in cases:
            for row in prefill_case(T, H, D, dtype, device, chunk_size, args.breakdown):
                out.write({**meta, **row})
                print(f"prefill T={T:6d} H={H:3d} K=V={D} {row['backend']:12s} {row['ms']:8.3f} ms "
                      f"{row['tflops']:7.1f} TFLOP/s", flush=True)  # fmt: skip
                for name, us in row.get("kernels_us", {}).items():
                    print(f"    {us:9.1f} us  {name}")
    return out.records


def run_decode(args, device, meta) -> list[dict]:
    smoke_cases = [(1, 2, 16, 1), (3, 2, 16, 2)]
    heads, dim = args.decode_heads, args.decode_dim
    cases = smoke_cases if args.smoke else [(n, heads, dim, t) for t in args.tokens for n in args.ns]
    copy = copy_tbps(device, gib=1 / 1024 if args.smoke else 2)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    with JsonlWriter(args.out / "kda_decode.jsonl") as out:
        for config in [None, *SWEEP] if args.sweep else [None]:
            for n, h, d, t in cases:
                with forced_config(config):
                    row = {**meta, **decode_case(n, h, d, t, dtype, device)}
                row["config"] = "auto" if config is None else "forced"
                row.update(copy_tbps=copy, floor_ms=2 * n * h * d * d * 4 / copy / 1e9)
                row["pct_of_copy"] = 100 * row["tbps"] / copy
                out.write(row)
                print(
                    f"decode N={n:4d} H={h} K=V={d} T={t} BV={row['bv']:3d} BT={row['bt']} warps={row['num_warps']} "
                    f"({row['config']}): {row['ms'] * 1e3:9.1f} us  {row['tbps']:.2f} TB/s state "
                    f"({row['pct_of_copy']:.0f}% of copy {copy:.2f} TB/s, floor {row['floor_ms'] * 1e3:.1f} us)",
                    flush=True,
                )
    return out.records


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", nargs="+", choices=["prefill", "decode"], default=["prefill", "decode"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter when there is no GPU)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="directory for the JSONL")
    p.add_argument("--T", nargs="+", type=int, default=[2048, 8192, 16384], help="prefill sequence lengths")
    p.add_argument("--H", nargs="+", type=int, default=[32, 64, 96], help="prefill head counts")
    p.add_argument("--breakdown", action="store_true", help="prefill: also time each kernel (GPU)")
    p.add_argument("--chunk-size", type=int, choices=[16, 32, 64], default=64, help="prefill: chunk_kda's chunk size")
    p.add_argument("--ns", nargs="+", type=int, default=[1, 64, 256], help="decode sequence counts")
    p.add_argument("--tokens", nargs="+", type=int, default=[1], help="decode tokens per sequence (1 = decode)")
    p.add_argument("--sweep", action="store_true", help="decode: also time every (BV, num_warps) in SWEEP")
    p.add_argument("--decode-heads", type=int, default=32, help="decode: KDA heads (the demo model has 4)")
    p.add_argument("--decode-dim", type=int, default=128, help="decode: K = V per head (the demo model's: 64)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = run_metadata()
    records = []
    if "prefill" in args.phase:
        records += run_prefill(args, device, meta)
    if "decode" in args.phase:
        records += run_decode(args, device, meta)
    return records


if __name__ == "__main__":
    main()
