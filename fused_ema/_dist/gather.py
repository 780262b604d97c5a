"""ema.full_state_dict(): every EMA tensor whole, by name. An FSDP2 / tensor-parallel DTensor is
all-gathered, the chunks of ModelEma(shard=...) are gathered in buckets of their flat buffers; the
result is kept on one rank or on all. Above dtensor.py and shard.py, which it uses."""

from __future__ import annotations

import torch

from .._ext.grad import without_grad
from .dtensor import is_dtensor, local
from .shard import gather_into


def gather_full(entries, rank, cpu_offload: bool, replicated: bool = False) -> dict:
    """ema.full_state_dict(): whole, plain tensors by name; a DTensor is all-gathered (every rank
    must call), and only `rank` keeps the result (rank=None: every rank). `replicated`: the
    sharded EMA of a replicated model, gathered in buckets of its flat buffers."""
    return without_grad(_gather_full, entries, rank, cpu_offload, replicated)


def _gather_full(entries, rank, cpu_offload: bool, replicated: bool) -> dict:
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    keep = rank is None or not distributed or dist.get_rank() == rank
    out = {}
    gathered: dict = {}
    replicas = [e for e in entries if replicated and is_dtensor(e.ema)]
    if replicas:  # ModelEma(shard=...): bucketed gathers, straight into the results
        where = "cpu" if cpu_offload else None
        full = [
            torch.empty(e.ema.shape, dtype=e.ema.dtype, device=where or local(e.ema).device)
            if keep
            else None
            for e in replicas
        ]
        gather_into([(e.ema, t) for e, t in zip(replicas, full)])
        gathered = {id(e): t for e, t in zip(replicas, full)}
    for entry in entries:
        if id(entry) in gathered:
            if keep:
                out.update({name: gathered[id(entry)] for name in entry.names})
            continue
        value = entry.ema.detach()
        value = value.full_tensor() if is_dtensor(value) else value  # every rank joins
        if not keep:
            continue
        value = value.to("cpu") if cpu_offload else value
        if value.untyped_storage().data_ptr() == local(entry.ema).untyped_storage().data_ptr():
            value = value.clone()  # a copy, never the live EMA
        for name in entry.names:
            out[name] = value
    return out
