"""What `LLM(..., tensor_parallel_size=T, context_parallel_size=C)` needs on each rank: the sharded, communicating
model (and the communicator it uses). The cache is `helix.helix_cache`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .distributed import Communicator, init_distributed
from .mapping import Mapping
from .tp import load_sharded, parallelize, shard_model


def parallel_model(
    model, tp: int, cp: int, *, dtype=None, device=None, comm: Communicator | None = None, timeout_s: float = 60.0
):
    """This rank's shard of `model` (a checkpoint directory, read slice by slice, or a full in-memory
    `KimiK3ForCausalLM`, sharded in place) with its collectives installed; returns (model, communicator).

    Joins the process group from torchrun's environment when none exists (collective timeout `timeout_s`, after
    which a failed rank is named); `comm` overrides the groups.
    """
    if comm is None:
        ctx = None
        if not dist.is_initialized():
            ctx = init_distributed(timeout_s=timeout_s, device=device)
        if dist.get_world_size() != tp * cp:
            raise ValueError(
                f"tensor_parallel_size * context_parallel_size = {tp} * {cp} must equal the world size "
                f"({dist.get_world_size()} ranks)"
            )
        comm = Communicator.create(Mapping(tp=tp, cp=cp, rank=dist.get_rank()), ctx)
    mapping = comm.mapping
    if (mapping.tp, mapping.cp) != (tp, cp):
        raise ValueError(f"the communicator's mapping is tp={mapping.tp}, cp={mapping.cp}; asked for tp={tp}, cp={cp}")
    device = torch.device(device or (comm.ctx.device if comm.ctx is not None else "cpu"))
    if isinstance(model, (str, Path)):
        model = load_sharded(model, mapping, dtype=dtype, device=device)
    else:
        model = shard_model(model.to(device=device, dtype=dtype) if dtype is not None else model.to(device), mapping)
    return parallelize(model, comm), comm
