"""Without a GPU, Triton kernels run on the CPU interpreter. The variable must be set before anything imports
triton.language (importing kimi_helix does, through torch), so it is set here, before every test module."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
