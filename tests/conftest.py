"""Without a GPU, Triton kernels run on the CPU interpreter. The variable must be set before anything imports
triton.language (importing kimi_helix does, through torch), so it is set here, before every test module.

Without a GPU the tests also run torch on one intra-op thread (and so do the processes they start) unless
OMP_NUM_THREADS says otherwise: their tensors are tiny, and a second thread mostly waits for the first. On a loaded
2-core machine that wait made the speculative tests 10x slower (101 s against 10 s), and under `pytest -n 2` (CI) each
worker already has a core of its own."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
