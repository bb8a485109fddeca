"""Kernel launches and host syncs per engine phase of a decoding round, counted without a profiler.

    python scripts/count_launches.py                   # plain and dspark k=5 on the demo model, on the CPU
    python scripts/count_launches.py --device cuda     # the same, eager on the GPU, with torch's sync detector

Used by `scripts/profile_round.py --count`. Every step runs eagerly (no CUDA graphs: a replayed graph launches the
nodes counted here). Per phase (prefill forward, draft forward, context write, verify forward, verify read-back,
sampling, rollback, the rest) it counts:

- launches: the aten ops that run a kernel (views, allocations and metadata ops excluded) plus Triton launches.
  On the CPU the fused ops are forced to their Triton kernels (under TRITON_INTERPRET=1) so that the count is the
  GPU's, one launch per fused kernel, not its torch reference's ops;
- syncs: on the GPU, the syncs torch's sync debug mode reports; on the CPU, the host reads a GPU would sync on
  (`.item()`, `.tolist()`, `nonzero`, `repeat_interleave` without `output_size`, ...), with their call sites.
  The offsets `ForwardBatch` keeps on the host are not counted; other host tensors' reads would be: read the sites.

The counts are per prompt for the prefill and per round (verify step, or decode step for plain) for the rest.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

# before Triton's decorators and the backend choice run (the backend variables are read when the model is built)
if "--device" not in sys.argv or "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("KIMI_HELIX_KERNEL_BACKEND", "triton")
    os.environ.setdefault("KIMI_HELIX_ATTENTION_BACKEND", "triton")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten
# ops that allocate, reshape or answer a question without running a kernel (torch does not call them views:
# `promote_types` returns a dtype, `_unsafe_view` is the view reshape returns without autograd tracking)
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default,
         aten.lift_fresh.default, aten._local_scalar_dense.default, aten.set_.source_Storage_storage_offset,
         aten.resize_.default, aten.is_pinned.default, aten._pin_memory.default, aten.promote_types.default,
         aten._unsafe_view.default}  # fmt: skip
# ops whose result the host needs before it can go on (a device sync on the GPU)
_SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
          aten.unique_consecutive.default, aten._unique2.default}  # fmt: skip


def _site() -> str:
    """The innermost frame of the package (or the scripts) that led here, as path:line function."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if "kimi_helix" in path.parts and "count_launches" not in path.name:
            return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{frame.lineno} {frame.name}"
    return "?"


class Counts(TorchDispatchMode):
    """Counts launches and syncs per label (the innermost `phase` open), the rest under "other"."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.labels: list[str] = []
        self.launches: Counter = Counter()
        self.syncs: Counter = Counter()
        self.sites: dict[str, Counter] = defaultdict(Counter)
        self.ops: dict[str, Counter] = defaultdict(Counter)  # label -> launches by op or Triton kernel name
        self.paused = 0

    @property
    def label(self) -> str:
        return self.labels[-1] if self.labels else "other"

    @contextmanager
    def phase(self, label: str):
        self.labels.append(label)
        try:
            yield
        finally:
            self.labels.pop()

    def sync(self, what: str) -> None:
        if not self.paused:
            self.syncs[self.label] += 1
            self.sites[self.label][f"{what} at {_site()}"] += 1

    def triton_launch(self, name: str) -> None:
        if not self.paused:
            self.launches[self.label] += 1
            self.ops[self.label][f"triton {name}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            if not func.is_view and func not in _FREE:
                self.launches[self.label] += 1
                self.ops[self.label][func.overloadpacket.__name__] += 1
            if self.device.type == "cpu":
                if func in _SYNCS:
                    self.sync(func.__name__)
                elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                    self.sync("repeat_interleave")
        return func(*args, **kwargs)


@contextmanager
def counting(device: torch.device):
    """A `Counts` recording everything until exit: aten ops, Triton launches and the syncs (see the module)."""
    import triton.runtime.jit as jit

    from kimi_helix.modeling import packing

    counts = Counts(device)
    patched = []
    packing_devices = packing.PACK_DEVICES
    packing.PACK_DEVICES = ("cuda", "cpu")  # pack as on the GPU, so that the CPU counts its launches

    def patch(owner, name, wrapper):
        old = getattr(owner, name)
        patched.append((owner, name, old))
        setattr(owner, name, wrapper(old))

    def launch(old):
        def run(self, *args, **kwargs):
            fn = getattr(self, "fn", None)
            counts.triton_launch(getattr(fn, "__name__", None) or getattr(self, "__name__", "?"))
            counts.paused += 1  # the interpreter's own tensor copies are not the kernel's launches
            try:
                return old(self, *args, **kwargs)
            finally:
                counts.paused -= 1

        return run

    patch(jit.JITFunction, "run", launch)
    try:
        from triton.runtime.interpreter import InterpretedFunction

        patch(InterpretedFunction, "run", launch)
    except ImportError:
        pass
    if device.type == "cpu":  # tolist reads a CPU tensor's memory without dispatching an op
        from kimi_helix.modeling.batch import ForwardBatch

        host = {}  # id -> weakref of the tensors that stay on the host on a GPU too (not syncs)

        def host_tensor(old):
            def wrapped(self, *args):
                t = old(self, *args)
                host[id(t)] = weakref.ref(t)
                return t

            return wrapped

        def tolist(old):
            def wrapped(self):
                ref = host.get(id(self))
                if ref is None or ref() is not self:
                    counts.sync("tolist")
                return old(self)

            return wrapped

        if hasattr(ForwardBatch, "_prefix_sums"):  # (absent before the host offsets: counts an older tree too)
            patch(ForwardBatch, "_prefix_sums", host_tensor)
        patch(torch.Tensor, "tolist", tolist)
    else:
        torch.cuda.set_sync_debug_mode("warn")
    old_showwarning = warnings.showwarning

    def showwarning(message, category, *args, **kwargs):
        if "synchronizing" in str(message).lower():
            counts.sync("cuda sync")
            return
        old_showwarning(message, category, *args, **kwargs)

    warnings.showwarning = showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = showwarning
            with counts:
                yield counts
    finally:
        warnings.showwarning = old_showwarning
        packing.PACK_DEVICES = packing_devices
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        for owner, name, old in reversed(patched):
            setattr(owner, name, old)


def label_phases(llm, counts: Counts) -> None:
    """Wrap the engine's phases so that what they launch is counted under their names."""
    from kimi_helix.engine import llm as llm_module
    from kimi_helix.modeling.batch import Phase

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def wrapped(*args, **kwargs):
            with counts.phase(label(*args) if callable(label) else label):
                return fn(*args, **kwargs)

        setattr(owner, name, wrapped)

    def forward_label(inputs):
        phases = set(inputs.batch.phases)
        return "prefill" if Phase.PREFILL in phases else "verify" if Phase.VERIFY in phases else "decode"

    wrap(llm.runner, "forward", forward_label)
    wrap(llm.runner, "prepare", "stage")
    wrap(llm.cache, "rollback", "rollback")
    wrap(llm_module, "sample", "sample")
    spec = llm.speculative
    if spec is not None:
        wrap(spec.proposer, "propose_on_device", "draft")
        wrap(spec.proposer, "propose", "draft")
        wrap(spec, "observe", "context write")
        wrap(spec, "verify_groups", "verify read")


def count(llm, prompt, max_tokens: int, ops: int = 0) -> None:
    """Generate once untimed, then once counted; print launches and syncs per phase (and its `ops` most launched
    ops or kernels)."""
    from kimi_helix.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    first = len(llm.metrics)
    with counting(llm.device) as counts:
        label_phases(llm, counts)
        llm.generate([prompt], params, use_tqdm=False)
    steps = llm.metrics[first:]
    rounds = sum(1 for s in steps if s.verify_groups) or sum(1 for s in steps if s.scheduled_tokens == 1)
    print(f"  {len(steps)} steps, {rounds} rounds; launches and syncs per round (prefill: per prompt):")
    for label in sorted(set(counts.launches) | set(counts.syncs)):
        per = 1 if label == "prefill" else rounds
        print(f"  {label:<14}{counts.launches[label] / per:9.1f} launches {counts.syncs[label] / per:7.2f} syncs")
        if ops:
            top = counts.ops[label].most_common(ops)
            print("      " + ", ".join(f"{name} {n / per:.1f}" for name, n in top))
    for label, sites in sorted(counts.sites.items()):
        for site, n in sites.most_common(12):
            print(f"    sync in {label}: {n}x {site}")


def main(argv=None) -> int:
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_spec

    from kimi_helix.assets import default_drafter_dir, demo_model_dir
    from kimi_helix.engine import LLM
    from kimi_helix.modeling.checkpoint import read_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["plain", "dspark"], choices=("plain", "ngram", "dspark"))
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ops", type=int, default=0, metavar="N", help="also list each phase's N most launched ops")
    args = p.parse_args(argv)
    args.num_prompts, args.seed, args.prompts = 1, 0, None
    args.prompt_lookup_min, args.prompt_lookup_max = 1, 4
    model_dir = Path(demo_model_dir())
    prompt = bench_spec.heldout_prompts(args, model_dir, read_config(model_dir).vocab_size)[0]
    for method in args.methods:
        k = args.k if method != "plain" else 0
        spec = bench_spec.speculative_config(method, k, default_drafter_dir(model_dir), args)
        max_len = len(prompt) + args.max_tokens + k + 1
        llm = LLM(model_dir, device=args.device, page_size=16, max_num_seqs=1, max_model_len=max_len,
                  num_pages=4 * -(-max_len // 16), speculative_config=spec, enforce_eager=True)  # fmt: skip
        print(f"== {method} k={k} on {args.device}, prompt {len(prompt)} tokens:")
        count(llm, prompt, args.max_tokens, args.ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
