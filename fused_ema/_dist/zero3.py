"""DeepSpeed ZeRO-3 parameters: `p.data` is an empty placeholder and each rank holds one flat,
row-major slice of every parameter in `p.ds_tensor` (its last elements padding on the last ranks),
a view into the optimizer's flat buffer that each step updates in place. The EMA of such a
parameter is a 1-D tensor of this rank's valid slice, averaged straight from it: no collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .dtensor import local


def is_zero3(t) -> bool:
    """Whether `t` is a parameter partitioned by ZeRO-3 (deepspeed.zero.Init or stage 3). Checked
    by attribute so that nothing imports deepspeed; persistent parameters count too, for their
    ds_tensor is a partition like any other (p.data is whole only after a forward or a step)."""
    return getattr(t, "ds_tensor", None) is not None and hasattr(t, "ds_numel")


def offset(p) -> int:
    """Row-major index, in the full flattened `p`, of the first element of this rank's partition
    (also the key stochastic rounding draws by, so a ZeRO-3 EMA rounds as an unsharded one). Every
    rank's partition has p.ds_tensor.ds_numel elements, padding included."""
    return dist.get_rank(group=p.ds_process_group) * p.ds_tensor.ds_numel


def valid_numel(p) -> int:
    """How many of this rank's partition elements are `p`'s (the rest is padding, garbage)."""
    return max(0, min(p.ds_tensor.ds_numel, p.ds_numel - offset(p)))


def cut(p) -> tuple[int, int, int]:
    """(dim, start, length) of `p.ds_tensor` that the EMA averages, in the form of the rows cut of
    ModelEma(shard=...) (plan.DeviceGroup.cuts), applied to base(p) instead of p itself."""
    return 0, 0, valid_numel(p)


def base(t: torch.Tensor) -> torch.Tensor:
    """What a cut narrows: the partition of a ZeRO-3 parameter, else the tensor itself."""
    return t.ds_tensor if is_zero3(t) else t


def partition(p) -> torch.Tensor:
    """This rank's valid partition elements of `p`: a view, live through optimizer steps."""
    return p.ds_tensor.narrow(*cut(p))


def copied(t: torch.Tensor) -> torch.Tensor:
    """What an unaveraged EMA entry copies of model tensor `t`: a ZeRO-3 parameter's valid
    partition, else its local shard (`t` itself unless a DTensor)."""
    return partition(t) if is_zero3(t) else local(t)


def holder(entries) -> dict | None:
    """{"rank", "world"} of the ZeRO-3 partitions that EMA `entries` hold (a state dict of them
    loads back only there; checkpoint.py compares it), or None when they hold none."""
    for e in entries:
        p = e.bound()
        if p is not None and is_zero3(p) and same_layout(e.ema, p) and e.ema.shape != p.ds_shape:
            group = p.ds_process_group
            return {"rank": dist.get_rank(group=group), "world": dist.get_world_size(group=group)}
    return None


def same_layout(ema: torch.Tensor, p) -> bool:
    """Whether the EMA tensor `ema` still fits the ZeRO-3 parameter `p` on this rank."""
    return ema.dim() == 1 and ema.shape[0] == valid_numel(p)


def gather_full(ema: torch.Tensor, p) -> torch.Tensor:
    """The whole EMA of ZeRO-3 parameter `p`, in its shape, from every rank's EMA of its valid
    partition (a collective over p's process group: never in update())."""
    part = p.ds_tensor.ds_numel  # padding included
    padded = ema.new_zeros(part)
    padded[: ema.numel()] = ema
    out = ema.new_empty(part * dist.get_world_size(group=p.ds_process_group))
    dist.all_gather_into_tensor(out, padded, group=p.ds_process_group)
    return out[: p.ds_numel].view(p.ds_shape)


def release(params) -> None:
    """Frees what has been gathered of ZeRO-3 parameters (a forward may keep it for reuse, and a
    persistent parameter stays whole), so that the next forward gathers their partitions again."""
    for p in params:
        if p.ds_status.name == "AVAILABLE":
            p.partition()


def write(ema: torch.Tensor, p) -> None:
    """Writes `ema`, the EMA of ZeRO-3 parameter `p`, into `p` so that it lasts: into its valid
    partition and, where an optimizer holds one, into its fp32 master partition (which the next
    step starts from and writes back over the partition). Idempotent."""
    partition(p).copy_(ema)
    if p.requires_grad and hasattr(p, "_z3_optimizer"):
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

        master = safe_get_local_fp32_param(p).clone()
        master[: ema.numel()] = ema
        safe_set_local_fp32_param(p, master)


def take_partition(tensor: torch.Tensor, p) -> torch.Tensor:
    """This rank's valid partition elements of a whole value of ZeRO-3 parameter `p` (a loaded
    full checkpoint's tensor)."""
    return tensor.reshape(-1).narrow(0, offset(p), valid_numel(p))
