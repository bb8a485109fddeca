"""Registers, spills and instruction mix of the Triton kernels at their committed launch settings, for sm_90
(H100/H200), without a GPU: each kernel is compiled with ``triton.compile`` and its cubin read with the
``cuobjdump`` that Triton's wheel carries.

    python scripts/kernel_resources.py                      # KDA prefill kernels at H=64 and MLA decode schedules
    python scripts/kernel_resources.py --ops kda --H 32     # the KDA prefill kernels as launched for H=32
    PYTHONPATH=/tmp/t36 python scripts/kernel_resources.py  # with the GPU machine's Triton (pip install --no-deps
                                                            # --target /tmp/t36 triton==3.6.0): counts differ
                                                            # between Triton versions

Columns: registers a thread, stack bytes a thread (register spills), shared memory bytes, and SASS instruction
counts: HGMMA (warpgroup tensor-core MMA), HMMA (warp-level MMA), LDGSTS (cp.async global -> shared copies), UTMALDG
(TMA tile loads) and
LDL/STL (local-memory loads and stores: spill traffic). Static counts, not timings.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kimi_helix.kernels.kda import chunk
from kimi_helix.kernels.kda.chunk_h import kda_chunk_state_kernel
from kimi_helix.kernels.kda.chunk_intra import kda_chunk_gate_kernel, kda_chunk_intra_kernel
from kimi_helix.kernels.kda.chunk_intra_blocks import kda_chunk_intra_blocks_kernel
from kimi_helix.kernels.kda.chunk_intra_halves import kda_chunk_intra_halves_kernel
from kimi_helix.kernels.kda.chunk_o import kda_chunk_output_kernel
from kimi_helix.kernels.kda.chunk_wy import kda_chunk_wy_kernel
from kimi_helix.kernels.mla import decode

TARGET = GPUTarget("cuda", 90, 32)
SASS = ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDL", "STL")
# Argument types by name; any other pointer is a bf16 tensor (the model's activations). g is the benchmark's given
# log-decay, fp32.
_FP32_PTRS = {"g", "G", "Ai", "rnorm", "h0", "ht", "A_log", "dt_bias", "kv_scale_ptr", "lse_ptr", "out_ptr"}
_INT_PTRS = {"route", "cu_seqlens", "chunk_indices", "chunk_offsets", "state_indices", "block_table_ptr",
             "cache_seqlens_ptr", "cu_seqlens_q_ptr", "kv_bounds_ptr"}  # fmt: skip
_FP32_SCALARS = {"scale", "qk_scale", "lower_bound"}


def _signature(fn, constexprs: dict, overrides: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in overrides:
            sig[name] = overrides[name]
        elif name.startswith(("stride_", "num_")):
            sig[name] = "i32"
        elif name in _FP32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "*fp32" if name in _FP32_PTRS else "*i32" if name in _INT_PTRS else "*bf16"
    return sig


def _cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def resources(fn, constexprs: dict, num_warps: int, num_stages: int, overrides: dict | None = None,
              maxnreg: int | None = None) -> dict:  # fmt: skip
    """Compile `fn` for sm_90 (registers capped at `maxnreg` if given) and read its resource usage and SASS
    instruction counts from the cubin."""
    signature = _signature(fn, constexprs, overrides or {})
    # As the launcher specialises them: torch's allocations are 16-byte aligned, and the strides at real shapes are
    # multiples of 16 elements. Without these hints Triton cannot vectorise loads or issue cp.async.
    aligned = [i for i, (name, ty) in enumerate(signature.items()) if ty.startswith("*") or name.startswith("stride_")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
    kernel = triton.compile(src, target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = _cuobjdump("--dump-resource-usage", str(cubin))
        sass = _cuobjdump("-sass", str(cubin))
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}
    # instruction lines look like "/*1a30*/  @!P0 HMMA.16816.F32.BF16 R4, ..." (address, optional predicate, opcode)
    ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", sass, flags=re.MULTILINE)
    counts = {op: ops.count(op) for op in SASS}
    return dict(regs=field.get("REG"), stack=field.get("STACK"), shared=kernel.metadata.shared, **counts)


def kda_cases(H: int, K: int = 128, V: int = 128) -> list[tuple]:
    """(name, fn, constexprs, warps, stages, overrides, maxnreg) of the KDA prefill kernels as chunk_kda launches
    them for bf16 inputs, one sequence, the L2 norm in the kernel and the gate given."""
    common = dict(H=H, K=K, BT=64, USE_QK_L2NORM=True, DOT_PRECISION="tf32", BETA_LOGITS=True)
    intra = dict(common, BC=16)
    I, B, W, S, O = chunk.INTRA, chunk.BLOCKS, chunk.WY, chunk.STATE, chunk.OUTPUT  # noqa: E741
    BV = chunk.state_block(1, H, V, None)
    cases = [
        ("kda gate", kda_chunk_gate_kernel,
         dict(H=H, K=K, BT=64, BK=chunk.GATE["BK"], GATE_IN_KERNEL=False, USE_LOWER_BOUND=False, WIDE=I["wide"],
              HALVES=I["halves"]),
         chunk.GATE["num_warps"], 3, None),
        ("kda intra, chunk-wide", kda_chunk_intra_kernel, dict(intra, BKS=I["BKS"]), I["num_warps"],
         I["num_stages"], I["maxnreg"]),
        ("kda intra, halves", kda_chunk_intra_halves_kernel, dict(intra, BKS=chunk.HALVES["BKS"]),
         chunk.HALVES["num_warps"], chunk.HALVES["num_stages"], chunk.HALVES["maxnreg"]),
        ("kda intra, blocks", kda_chunk_intra_blocks_kernel, dict(intra, BKS=B["BKS"]),
         B["num_warps"], B["num_stages"], B["maxnreg"]),
        ("kda wy", kda_chunk_wy_kernel, dict(H=H, K=K, V=V, BT=64, BS=W["BS"], DOT_PRECISION="tf32", SPLIT=W["split"],
                                          BETA_LOGITS=True),
         W["num_warps"], W["num_stages"], W["maxnreg"]),
        (f"kda state (BV={BV}{', with o' if S['output'] else ''})", kda_chunk_state_kernel,
         dict(H=H, K=K, V=V, BT=64, BK=K, BV=BV, USE_INITIAL_STATE=False, STORE_FINAL_STATE=True,
              USE_STATE_INDICES=False, FUSE_OUTPUT=S["output"], DOT_PRECISION="tf32"), S["num_warps"], S["num_stages"],
         None),
        ("kda output (runs without STATE['output'])", kda_chunk_output_kernel,
         dict(H=H, K=K, V=V, BT=64, BK=K, BV=O["BV"], DOT_PRECISION="tf32"), O["num_warps"], O["num_stages"], None),
    ]  # fmt: skip
    return [(name, fn, c, w, s, {}, maxnreg) for name, fn, c, w, s, maxnreg in cases]


def mla_cases() -> list[tuple]:
    """The MLA decode kernel at each committed schedule (bf16 q, page size 64, split KV, its latent column groups),
    with TMA tiles where the schedule asks for them and they fit inside a page."""
    cases = []
    for (kv_bytes, rows), sched in decode.SCHEDULES.items():
        fp8 = kv_bytes == 1
        tma = sched.tma and 64 % sched.block_n == 0
        # an fp8 cache computes in fp16 (decode_fp8.py)
        c = dict(PAGE_SIZE=64, DC=512, DR=64, BLOCK_H=rows, BLOCK_Q=1, BLOCK_N=sched.block_n, DSPLIT=sched.d_split,
                 SEQS_POW2=256, COMPUTE_DTYPE=tl.float16 if fp8 else tl.bfloat16, DOT_PRECISION="tf32", IS_FP8=fp8,
                 USE_KV_BOUNDS=False, SPLIT=True, RESCALE_SLACK=sched.rescale_slack, USE_TMA=tma)  # fmt: skip
        kv = "fp8e4nv" if fp8 else "bf16"
        overrides = {"kv_ptr": f"*{kv}"}
        if tma:
            overrides.update(kv_c_desc=f"tensordesc<{kv}[1, {sched.block_n}, {512 // sched.d_split}]>",
                             kv_pe_desc=f"tensordesc<{kv}[1, {sched.block_n}, 64]>")  # fmt: skip
        else:
            c.update(kv_c_desc=None, kv_pe_desc=None)
        groups = f", {sched.d_split} column groups" if sched.d_split > 1 else ""
        name = f"mla decode {'fp8' if fp8 else 'bf16'} KV, {rows} rows x {sched.block_n} keys{groups}"
        name += ", TMA" if tma else ""
        cases.append((name, decode.mla_decode_fwd_kernel, c, sched.num_warps, sched.num_stages, overrides, None))
    sched = decode.SCHEDULES[(2, 64)]
    if sched.wgmma and decode.decode_wgmma is not None:
        cases.append(mla_wgmma_case(sched.block_n, sched.num_stages))
    for rows in (16, 32):
        if decode.SCHEDULES[(1, rows)].wgmma and decode.decode_fp8_wgmma is not None:
            cases.append(mla_fp8_wgmma_case(rows))
    return cases


def mla_wgmma_case(block_n: int, num_stages: int, page_size: int = 64, longest_first: bool = False) -> tuple:
    """The warp-specialised Gluon MLA decode kernel (64 rows, bf16, kv_lora_rank 512, rope 64) with block_n-key
    tiles in num_stages buffers, as a case of `main`'s table (registers: the launch's share; its partitions then
    re-divide them): split KV in sequence order, or (longest_first) whole sequences taken longest first."""
    from triton.experimental.gluon import language as gl

    def desc(width):
        layout = gl.NVMMASharedLayout.get_default_for([1, block_n, width], gl.bfloat16)
        return f"tensordesc<bf16[1, {block_n}, {width}],{layout!r}>"

    c = dict(PAGE_SIZE=page_size, BLOCK_H=64, BLOCK_Q=1, SEQS_POW2=256, USE_KV_BOUNDS=False, SPLIT=not longest_first,
             NUM_STAGES=num_stages, LONGEST_FIRST=longest_first)  # fmt: skip
    order = "longest first" if longest_first else "split KV"
    name = f"mla decode bf16 KV, 64 rows x {block_n} keys, {num_stages} buffers, {order}, Gluon wgmma (warp-spec.)"
    overrides = dict(kv_c_desc=desc(256), kv_pe_desc=desc(64))
    return name, decode.decode_wgmma.mla_decode_wgmma_kernel, c, 4, num_stages, overrides, None


def mla_fp8_wgmma_case(rows: int, block_h: int | None = None, page_size: int = 64, split: bool = True,
                       longest_first: bool = False, stages: int = 2, regs: int | None = None,
                       params=None) -> tuple:  # fmt: skip
    """The fp8-cache Gluon MLA decode kernel (`decode_fp8_wgmma`: e4m3 latents, bf16 q, kv_lora_rank 512, rope 64)
    at `rows` tile rows (block_h heads a tile, default all of them) and `stages` fp16 buffers, as a case of `main`'s
    table: split KV (fp32 partials) or one split (bf16 out), sequences in order or longest first. params: the
    dequant side's `decode.Fp8WgmmaParams` (default: the committed `decode.FP8_WGMMA`); regs overrides its
    registers."""
    from kimi_helix.kernels.mla import decode_fp8_wgmma as k

    block_h = block_h or rows
    params = params or decode.FP8_WGMMA
    regs = regs or params.dequant_regs
    c = dict(PAGE_SIZE=page_size, DC=512, DR=64, BLOCK_H=block_h, BLOCK_Q=rows // block_h, SEQS_POW2=256,
             USE_KV_BOUNDS=False, SPLIT=split, LONGEST_FIRST=longest_first, BLOCK_N=k.BLOCK_N, NUM_STAGES=stages,
             DEQUANT_REGS=regs, LOOKAHEAD=params.lookahead, DEQUANT_WGS=params.dequant_warpgroups,
             PREFETCH=params.l2_prefetch)  # fmt: skip
    order = ("split KV" if split else "one split") + (", longest first" if longest_first else "")
    name = f"mla decode fp8 KV, {rows} rows ({block_h} heads) x {k.BLOCK_N} keys, {stages} buffers, {order}, Gluon "
    name += f"wgmma swap-AB ({params.dequant_warpgroups} dequant warpgroup(s) at {regs} regs, "
    name += f"{params.lookahead} tiles ahead" + (f", L2 {params.l2_prefetch} further)" if params.l2_prefetch else ")")
    overrides = {"kv_ptr": "*fp8e4nv", "out_ptr": "*fp32" if split else "*bf16"}
    return name, k.mla_decode_fp8_wgmma_kernel, c, 4, stages, overrides, None


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", choices=("kda", "mla"), default=["kda", "mla"])
    ap.add_argument("--H", type=int, default=64, help="KDA heads (the state pass's block width depends on it)")
    ap.add_argument("--only", default=None, help="only the cases whose name contains this text")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the kernels must compile for the GPU target")
    cases = (kda_cases(args.H) if "kda" in args.ops else []) + (mla_cases() if "mla" in args.ops else [])
    cases = [c for c in cases if args.only is None or args.only in c[0]]
    if not cases:
        ap.error(f"no kernel name contains {args.only!r}")
    print(f"Triton {triton.__version__}, sm_90")
    header = ["kernel", "warps", "stages", "regs", "stack B", "shared B", *SASS]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    rows = []
    for name, fn, constexprs, warps, stages, overrides, maxnreg in cases:
        usage = resources(fn, constexprs, warps, stages, overrides, maxnreg)
        row = dict(kernel=name, warps=warps, stages=stages, **usage)
        rows.append(row)
        print("| " + " | ".join(str(row[k]) for k in ("kernel", "warps", "stages", "regs", "stack", "shared", *SASS))
              + " |", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
