"""Helix on NCCL: `torchrun scripts/generate.py --cp C` equals the one-GPU run token for token, and its bf16 logits
are as close to the one-GPU bf16 logits as those are to the one-GPU fp32 logits.

The checkpoint has the kimi-linear-48b-a3b shapes cut to 8 layers (two MLA layers) with 16 routed experts instead
of 256, so it is 3 GB rather than 28 GB on disk; the expert count does not touch the Helix path. Every process runs
with NVLink multicast off.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "generate.py")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# 4 pages of 64 tokens (the default page) and more, so that every rank of cp = 4 owns part of the context
PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n" * 3
NEW_TOKENS = "24"

pytestmark = pytest.mark.gpu


def _run(args: list[str], timeout: float = 300) -> str:
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kimi_helix import KimiK3ForCausalLM
    from kimi_helix.tokenizer import build_byte_tokenizer

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_e2e import truncated_config

    config = truncated_config("kimi-linear-48b-a3b", 8)
    config = type(config)(**{**config.to_dict(), "num_experts": 16})
    out = tmp_path_factory.mktemp("helix8")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = KimiK3ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def _generate(checkpoint: Path, tmp: Path, dtype: str, cp: int = 1) -> tuple[str, list[torch.Tensor]]:
    logits = tmp / f"logits-{dtype}-cp{cp}.pt"
    args = [SCRIPT, "--model", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--dtype", dtype,
            "--cp", str(cp), "--save-logits", str(logits), "--timeout", "120"]  # fmt: skip
    if cp > 1:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), *args]
    text = _run(args)
    return text, torch.load(logits)


def _distance(a: list[torch.Tensor], b: list[torch.Tensor], steps: int) -> float:
    """Largest relative max-abs difference of the first `steps` steps' logits."""
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a[:steps], b[:steps]))


@pytest.fixture(scope="module")
def one_gpu(checkpoint, tmp_path_factory):
    """The one-GPU bf16 run, and how far its logits are from fp32 over the steps where both chose the same tokens
    (after the first different token their inputs differ)."""
    tmp = tmp_path_factory.mktemp("one_gpu")
    text, bf16 = _generate(checkpoint, tmp, "bfloat16")
    _, fp32 = _generate(checkpoint, tmp, "float32")
    same = next((i for i, (x, y) in enumerate(zip(bf16, fp32)) if x.argmax(-1) != y.argmax(-1)), len(bf16))
    return text, bf16, _distance(bf16, fp32, same + 1)


def _cp(n: int):
    have = torch.cuda.device_count()
    return pytest.param(n, marks=pytest.mark.skipif(have < n, reason=f"cp={n} needs {n} GPUs; this machine has {have}"))


@pytest.mark.parametrize("cp", [_cp(2), _cp(4)])
def test_nccl_helix_equals_one_gpu(cp, checkpoint, one_gpu, tmp_path):
    want, ref_logits, bf16_vs_fp32 = one_gpu
    text, logits = _generate(checkpoint, tmp_path, "bfloat16", cp)
    assert text == want and want.strip()
    assert len(logits) == len(ref_logits)
    assert _distance(logits, ref_logits, len(logits)) <= bf16_vs_fp32, bf16_vs_fp32
