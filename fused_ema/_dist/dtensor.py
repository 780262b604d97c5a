"""DTensor (FSDP2, tensor parallel) support: an EMA of a sharded parameter is a DTensor with the
same mesh and placements, and every update runs the fused kernel on the local shards only, so no
collective ever happens in update(). Works without torch.distributed too (nothing is a DTensor).
"""

from __future__ import annotations

import math

import torch

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
except ImportError:  # a torch built without distributed support
    DTensor = FSDPModule = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def chunk_dim(shape) -> int:
    """The dimension a sharded EMA of a replicated model is cut along: the first longer than 1,
    so that each chunk is one row-major block of the full tensor."""
    return next((d for d, size in enumerate(shape) if size > 1), 0)


def replica_cut(ema, src) -> tuple | None:
    """(dim, start, length): the part of the plain model tensor `src` that a sharded EMA tensor
    averages (ModelEma(shard=...) of a replicated model); None when they pair whole or shard by
    shard. (An FSDP2 EMA meets plain model tensors only while FSDP holds them unsharded, which
    refuse_unsharded turns away before any pairing.)"""
    if not is_dtensor(ema) or is_dtensor(src) or ema.device_mesh.ndim != 1:
        return None
    (placement,) = ema.placements
    if not placement.is_shard() or placement.dim != chunk_dim(ema.shape):
        return None
    return own_rows(ema.shape, ema.device_mesh.size(), ema.device_mesh.get_local_rank())


def own_rows(shape, world: int, rank: int) -> tuple[int, int, int]:
    """(dim, start, length): the rows of a tensor of `shape` that `rank`'s chunk holds when
    ModelEma(shard=...) cuts it into `world` chunks along chunk_dim, as torch.chunk and DTensor's
    Shard cut it (compute_local_shape_and_global_offset would cost ~100x more, per tensor of
    every plan made and structure checked)."""
    dim = chunk_dim(shape)
    rows = -(-shape[dim] // world)
    start = min(rank * rows, shape[dim])
    return dim, start, max(0, min(shape[dim], start + rows) - start)


def same_layout(ema: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether the EMA tensor `ema` still fits the model tensor `t` (shape and sharding)."""
    same_shape = tuple(ema.shape) == tuple(t.shape)
    return same_shape and (sharding(ema) == sharding(t) or replica_cut(ema, t) is not None)


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (the same tensor object every call, unlike to_local())."""
    return t._local_tensor if is_dtensor(t) else t


def sharding(t: torch.Tensor):
    """What must match between an EMA tensor and its model tensor beyond shape and dtype."""
    return (t.device_mesh, tuple(t.placements)) if is_dtensor(t) else None


def check_averageable(name: str, t: torch.Tensor) -> None:
    if is_dtensor(t) and any(isinstance(p, Partial) for p in t.placements):
        raise ValueError(
            f"{name} is a DTensor with a Partial placement (a pending reduction); "
            "average it after the reduction"
        )


def copy_into(ema: torch.Tensor, value: torch.Tensor) -> None:
    """ema <- value for any mix of plain tensors and DTensors (cast to the EMA's device/dtype); a
    plain `value` (held whole by every rank) gives each rank its shard, with no communication."""
    if ema is value or same_memory(local(ema), local(value)):
        return  # e.g. a state_dict() that dcp.load filled in place
    if not is_dtensor(ema):
        value = value.full_tensor() if is_dtensor(value) else value
    elif not is_dtensor(value):  # each rank cuts its own shard out of the whole value
        value = distribute_tensor(
            value.to(ema.device), ema.device_mesh, ema.placements, src_data_rank=None
        )
    elif sharding(value) != sharding(ema):
        value = value.redistribute(ema.device_mesh, ema.placements)
    local(ema).copy_(local(value))


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.numel() > 0
    )


def any_dtensor(tensors) -> bool:
    # Over the distinct types: a generator over the items cost about 85 ns a tensor, more than
    # half of a raw lerp_'s host cost.
    return DTensor is not None and any(issubclass(c, DTensor) for c in set(map(type, tensors)))


def shard_lists(ema: list, src: list, op: str, name: str) -> tuple[list, list]:
    """The local shards of DTensor pairs sharded alike: lerp is elementwise, so each rank
    updating its own shard is the whole update. `op` ("fused_ema.lerp_: ") and `name` (the
    list's, "ema") name them in errors."""
    ema_local, src_local = [], []
    for i, (e, s) in enumerate(zip(ema, src)):
        if is_dtensor(e) != is_dtensor(s):
            which, other = (name, "src") if is_dtensor(e) else ("src", name)
            raise ValueError(f"{op}{which}[{i}] is a DTensor but {other}[{i}] is not")
        if is_dtensor(e):
            check_averageable(f"src[{i}]", s)
            if sharding(e) != sharding(s):
                raise ValueError(
                    f"{op}{name}[{i}] and src[{i}] are sharded differently "
                    f"({e.placements} on {e.device_mesh} vs {s.placements} on {s.device_mesh})"
                )
        ema_local.append(local(e))
        src_local.append(local(s))
    return ema_local, src_local


def shard_offset(t: torch.Tensor, name: str) -> int:
    """The row-major index, in the full tensor, of the first element of this rank's shard of `t`
    (0 for a plain or replicated tensor). The shard must be one row-major block of the full
    tensor (Shard(0), as FSDP2 shards), else there is no such single index."""
    if not is_dtensor(t):
        return 0
    if tuple(t.placements) == (Shard(0),):
        # FSDP2's placement, by own_rows's arithmetic: torch's general offset below took 50-200
        # us a tensor here (6x or more this), at every call of the raw op.
        _, start, length = own_rows(
            (t.shape[0],), t.device_mesh.size(), t.device_mesh.get_local_rank()
        )
        return start * math.prod(t.shape[1:]) if length else 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, start = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    full = tuple(t.shape)
    cut = [d for d in range(len(full)) if shape[d] != full[d] or start[d] != 0]
    if not cut or min(shape) == 0:
        return 0
    first = cut[0]
    if any(full[d] != 1 for d in range(first)) or any(d != first for d in cut):
        raise ValueError(
            f"{name} is sharded as {t.placements} on "
            f"{t.device_mesh}, so its shard is not one row-major block of the full tensor; "
            "stochastic rounding of DTensors needs Shard(0) (or Replicate) placements"
        )
    return int(start[first]) * math.prod(full[first + 1 :])


def reshard_fsdp(model) -> None:
    """Puts every FSDP2 module back in its sharded state, dropping unsharded parameters that a
    forward pass left behind (after ema.swapped(), they would hold the EMA's weights)."""
    if FSDPModule is None:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def refuse_unsharded(by_name: dict, tracked, replicated=None) -> None:
    """An FSDP2 model between forward and backward holds unsharded parameters: refuse them. The
    sharded EMA of a replicated model (`replicated`: its ShardSpec) refuses sharded ones."""
    if replicated is not None:
        replicated.refuse_sharded(tracked)
        return
    plain = [t for t in tracked if not is_dtensor(t.tensor)]
    names = [n for t in plain for n in t.names if n in by_name and is_dtensor(by_name[n].ema)]
    if names:
        raise RuntimeError(
            f"{len(names)} sharded tensors of the model are unsharded right now (e.g. "
            f"{names[0]}): an FSDP2 model between forward and backward, or after an "
            "evaluation forward. Update the EMA after optimizer.step(), or call "
            "model.reshard() first. A model that is not sharded at all takes the EMA's values "
            "from model.load_state_dict(ema.full_state_dict(rank=None))."
        )
