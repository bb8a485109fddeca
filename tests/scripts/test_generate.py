"""`torchrun scripts/generate.py --tp T --cp C` prints the same greedy text as `kimi-helix generate` on one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _one_process(args, capsys) -> str:
    """`kimi-helix ARGS` in this process (the torchrun launches are the subprocesses under test); its stdout."""
    from kimi_helix.cli import main

    capsys.readouterr()
    assert main(args) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kimi_helix.cli import main

    out = tmp_path_factory.mktemp("tiny")
    assert main(["init", "--preset", "tiny", "--out", str(out), "--force"]) == 0
    return out


def test_torchrun_helix_matches_one_process(checkpoint, capsys):
    prompt, n = "Helix splits pages", "12"
    want = _one_process(["generate", "--model", str(checkpoint), "--prompt", prompt, "--max-new-tokens", n], capsys)
    got = _run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(ROOT / "scripts/generate.py"),
         "--model", str(checkpoint), "--tp", "1", "--cp", "2", "--page-size", "4", "--prompt", prompt,
         "--max-new-tokens", n]
    )  # fmt: skip
    assert got == want and want.strip()
    cli = _run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kimi_helix", "generate",
         "--model", str(checkpoint), "--cp", "2", "--page-size", "4", "--prompt", prompt, "--max-new-tokens", n]
    )  # fmt: skip
    assert cli == want  # the same flags on `kimi-helix generate` under torchrun


def test_torchrun_tp2_cp2_cli_matches_one_process(tmp_path, capsys):
    """tp = 2 and cp = 2 (four processes) through `kimi-helix generate --tp 2 --cp 2`: the single-process text."""
    import torch

    from kimi_helix import KimiK3ForCausalLM
    from kimi_helix.tokenizer import build_byte_tokenizer

    from ..parallel.harness import parallel_test_config

    torch.manual_seed(0)
    KimiK3ForCausalLM(parallel_test_config()).save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    prompt, n = "pages of a helix", "10"
    want = _one_process(["generate", "--model", str(tmp_path), "--prompt", prompt, "--max-new-tokens", n], capsys)
    got = _run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "kimi_helix", "generate",
         "--model", str(tmp_path), "--tp", "2", "--cp", "2", "--page-size", "4", "--prompt", prompt,
         "--max-new-tokens", n]
    )  # fmt: skip
    assert got == want and want.strip()
