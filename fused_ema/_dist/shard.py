"""ModelEma(shard=...): the EMA of a model replicated across a process group (DDP), sharded as FSDP2
lays out parameters (a Shard(d) DTensor of each averaged tensor, which DCP saves and reshards), its
chunks views into one flat buffer per dtype and device, laid out alike on every rank, so that one
all-gather gathers many tensors (docs/distributed.md). Also ema.full_state_dict()'s gather_full."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from .._ext.grad import without_grad
from . import zero3
from .dtensor import chunk, chunk_dim, is_dtensor, local

#: The bytes one bucket of a gather receives (all ranks' chunks together).
BUCKET_BYTES = 64 << 20
_ALIGN_BYTES = 64  # every chunk starts on a multiple: vector loads stay aligned
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def resolve(shard) -> ShardSpec | None:
    """The ShardSpec for ModelEma's `shard` argument (False/None: not sharded)."""
    if shard is False or shard is None:
        return None
    kind = "WORLD" if shard is True else type(shard).__name__
    if kind not in ("WORLD", "ProcessGroup", "DeviceMesh"):
        raise TypeError(
            "fused_ema: shard must be False, True (the default process group), a ProcessGroup or "
            f"a 1-D DeviceMesh, got {type(shard).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "fused_ema: shard=... splits the EMA across the ranks of a process group, and "
            "torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "first, or build the EMA without shard="
        )
    if kind == "WORLD":
        return ShardSpec(dist.group.WORLD)
    if kind == "ProcessGroup":
        return ShardSpec(shard)
    if shard.ndim != 1:
        raise ValueError(
            f"fused_ema: shard= takes a 1-D DeviceMesh (the ranks holding replicas of the "
            f"model), got one with {shard.ndim} dimensions; pass mesh['name'] of the "
            "replicate dimension"
        )
    return ShardSpec(shard.get_group(), shard)


def layout(shapes, world: int, itemsize: int) -> tuple[list, int]:
    """Where each tensor's chunk lies in a flat buffer, the same on every rank whatever its
    chunk's length: [(offset, capacity)] and the buffer's length, in elements. A capacity is the
    longest chunk (the first rank's), so the ranks' chunks end to end are the full tensor."""
    align = max(1, _ALIGN_BYTES // itemsize)
    slots, total = [], 0
    for shape in shapes:
        d = chunk_dim(shape)
        capacity = -(-shape[d] // world) * math.prod(shape[d + 1 :]) if math.prod(shape) else 0
        slots.append((total, capacity))
        total += -(-capacity // align) * align
    return slots, total


class ShardSpec:
    """The process group a sharded EMA is split over, and its meshes (one per device type)."""

    def __init__(self, group, mesh=None):
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("fused_ema: shard= names a process group this rank is not part of")
        self.group, self.rank, self.world = group, rank, dist.get_world_size(group)
        self.meshes = {} if mesh is None else {mesh.device_type: mesh}

    def mesh(self, device: torch.device):
        if device.type not in self.meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self.meshes[device.type] = DeviceMesh.from_group(self.group, device.type)
        return self.meshes[device.type]

    def __deepcopy__(self, memo):
        return self  # the process group is shared, not copied

    def __reduce__(self):
        raise TypeError(
            "a ModelEma built with shard=... holds a process group and cannot be pickled; save "
            "ema.state_dict() with torch.distributed.checkpoint (or ema.full_state_dict())"
        )

    # ------------------------------------------------------------------ entries

    def new_ema(self, t: torch.Tensor, device, dtype) -> torch.Tensor:
        """This rank's chunk of `t` as the EMA's dtype, on `device`, as a DTensor: a view of `t`
        where dtype and device match, for pack() copies every chunk into its flat buffer."""
        from torch.distributed.tensor import DTensor, Shard

        d = chunk_dim(t.shape)
        start, length = chunk(t.shape[d], self.world, self.rank)
        part = t.narrow(d, start, length)
        own = part.to(device=device, dtype=dtype)
        return DTensor.from_local(
            own,
            self.mesh(own.device),
            [Shard(d)],
            run_check=False,
            shape=t.shape,
            stride=torch.empty(t.shape, device="meta").stride(),
        )

    def pack(self, entries: list) -> list:
        """The entries with every chunk moved into one flat buffer per dtype and device (new
        entries and tensors: the ones given are left as they were)."""
        from torch.distributed.tensor import DTensor

        groups: dict = {}
        for k, e in enumerate(entries):
            if is_dtensor(e.ema):  # refuse_sharded: every DTensor here is a chunk of ours
                chunk_ = local(e.ema)
                groups.setdefault((chunk_.dtype, chunk_.device), []).append(k)
        out = list(entries)
        for (dtype, device), ks in groups.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            slots, total = layout([entries[k].ema.shape for k in ks], self.world, itemsize)
            flat = torch.zeros(total, dtype=dtype, device=device)
            for k, (offset, _) in zip(ks, slots):
                e = entries[k]
                old = local(e.ema)
                view = _alias(flat[offset : offset + old.numel()]).view(old.shape)
                view.copy_(old)
                ema = DTensor.from_local(
                    view,
                    e.ema.device_mesh,
                    e.ema.placements,
                    run_check=False,
                    shape=e.ema.shape,
                    stride=e.ema.stride(),
                )
                if isinstance(e.ema, nn.Parameter):
                    ema = nn.Parameter(ema, requires_grad=False)
                out[k] = dataclasses.replace(e, names=list(e.names), ema=ema)
        return out

    # ------------------------------------------------------------------ checks

    def refuse_sharded(self, tracked) -> None:
        names = [t.name for t in tracked if is_dtensor(t.tensor)]
        if names:
            raise ValueError(
                f"fused_ema: shard=... is for a model replicated across ranks (DDP), but "
                f"{len(names)} of its tensors are DTensors (e.g. {names[0]}: FSDP2 or tensor "
                "parallel); the EMA of a sharded model is sharded with it: build it without shard="
            )

    def check_replicated(self, tracked) -> None:
        """One all-gather of each rank's names, shapes, dtypes and value checksums: the same
        clear error on every rank when the model is not replicated identically."""
        meta = [t.name for t in tracked if t.tensor.is_meta]
        self.refuse_sharded(tracked)
        checksums = _checksums([t.tensor for t in tracked])
        signature = [
            (tuple(t.names), tuple(t.tensor.shape), str(t.tensor.dtype), checksum)
            for t, checksum in zip(tracked, checksums)
        ]
        every = [None] * self.world
        dist.all_gather_object(every, signature, group=self.group)
        problems = []
        for rank, other in enumerate(every):
            if rank == 0:
                continue
            problems += [f"rank {rank}: {p}" for p in _differences(every[0], other)]
        if problems:
            shown = "; ".join(problems[:6]) + ("; ..." if len(problems) > 6 else "")
            raise ValueError(
                "fused_ema: shard=... averages each rank's chunk from that rank's own copy of the "
                "model, so the model must be replicated identically on every rank (build the "
                f"EMA after wrapping it in DDP, which broadcasts rank 0's weights). Compared with "
                f"rank 0: {shown}"
            )
        if meta:
            raise ValueError(
                f"fused_ema: shard=... needs a materialised model; {len(meta)} tensors are on "
                f"the meta device (e.g. {meta[0]})"
            )


def _alias(view: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor of its own (storage offset 0): torch.save cannot save a
    DTensor whose local tensor starts inside its storage."""
    return torch.from_dlpack(view) if view.numel() else view.clone()


def _checksums(tensors) -> list:
    """Per tensor, the sum of its elements' bit patterns (exact, identical for identical
    values); one host read per device."""
    sums, where = {}, []
    for t in tensors:
        t = t.detach()
        kind = _INT_OF_SIZE.get(t.element_size())
        if t.is_meta or kind is None or t.dim() == 0 and t.is_complex():
            where.append(None)
            continue
        bits = t.reshape(1) if t.dim() == 0 else t
        bits = bits.view(kind) if bits.dtype != kind else bits
        group = sums.setdefault(t.device, [])
        where.append((t.device, len(group)))
        group.append(bits.sum(dtype=torch.int64))
    values = {d: torch.stack(v).tolist() for d, v in sums.items()}
    return [None if w is None else values[w[0]][w[1]] for w in where]


def _differences(mine: list, other: list) -> list:
    """How `other` rank's signature (names, shape, dtype, checksum per tensor) differs."""
    names_a = [n for t in mine for n in t[0]]
    names_b = [n for t in other for n in t[0]]
    if names_a != names_b:
        extra = [n for n in names_b if n not in set(names_a)]
        missing = [n for n in names_a if n not in set(names_b)]
        return [f"other tensors (has {extra[:3]}, lacks {missing[:3]})"]
    out = []
    for (names, shape, dtype, checksum), (_, shape_b, dtype_b, checksum_b) in zip(mine, other):
        if shape != shape_b:
            out.append(f"{names[0]} has shape {list(shape_b)}, not {list(shape)}")
        elif dtype != dtype_b:
            out.append(f"{names[0]} is {dtype_b}, not {dtype}")
        elif checksum != checksum_b:
            out.append(f"{names[0]} holds other values")
    return out


# ---------------------------------------------------------------------- gathering


def _comm_device(device: torch.device, group) -> torch.device:
    """Where a bucket is gathered: with the chunks, unless the backend cannot reach them (a CPU
    EMA over NCCL gathers on the current GPU)."""
    if device.type == "cpu" and "gloo" not in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return device


def gather_chunks(items: list, group, world: int) -> None:
    """All-gathers tensors split as ModelEma(shard=...) splits them, writing each whole tensor
    into its target. `items`: [(this rank's chunk, full shape, target or None)], one dtype and
    device, in the same order on every rank (a rank with None targets takes part without
    keeping anything). The chunks are laid out end to end, each with its longest chunk's
    capacity, and gathered in buckets of at most BUCKET_BYTES."""
    if not items:
        return
    first = items[0][0]
    itemsize = first.element_size()
    slots, total = layout([tuple(shape) for _, shape, _ in items], world, itemsize)
    step = max(1, BUCKET_BYTES // (world * itemsize))
    device = _comm_device(first.device, group)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    staged = {}  # non-contiguous targets: filled whole, then copied in
    send_buffer = torch.empty(min(step, total), dtype=first.dtype, device=device)
    out_buffer = torch.empty(world * min(step, total), dtype=first.dtype, device=device)
    for a in range(0, total, step):
        b = min(total, a + step)
        send = send_buffer[: b - a]
        for (offset, _), (part, _, _) in zip(slots, items):
            n = part.numel()
            lo, hi = max(a, offset) - offset, min(b, offset + n) - offset
            if hi > lo:
                send[offset + lo - a : offset + hi - a].copy_(part.reshape(-1)[lo:hi])
        out = out_buffer[: world * (b - a)]
        all_gather(out, send, group=group)
        out = out.view(world, b - a)
        for (offset, capacity), (_, _, target) in zip(slots, items):
            if target is None or capacity == 0 or offset >= b or offset + capacity <= a:
                continue
            _copy_out(out, a, b, offset, capacity, target.numel(), _flat_target(target, staged))
    for target, whole in staged.values():
        target.copy_(whole.view(target.shape))


def _flat_target(target: torch.Tensor, staged: dict) -> torch.Tensor:
    if target.is_contiguous():
        return target.view(-1)
    if id(target) not in staged:
        whole = torch.empty(target.numel(), dtype=target.dtype, device=target.device)
        staged[id(target)] = (target, whole)
    return staged[id(target)][1]


def _copy_out(out, a: int, b: int, offset: int, capacity: int, numel: int, dst) -> None:
    """The part of one tensor that bucket [a, b) holds: rank r's chunk is elements
    [r * capacity, (r + 1) * capacity) of the full tensor (the last ones shorter or empty)."""
    q0, q1 = max(a, offset) - offset, min(b, offset + capacity) - offset
    col = offset + q0 - a
    if q0 == 0 and q1 == capacity:  # whole: the full ranks in one copy, then the last one
        full = numel // capacity
        if full:
            dst[: full * capacity].view(full, capacity).copy_(out[:full, col : col + capacity])
        rest = numel - full * capacity
        if rest:
            dst[full * capacity :].copy_(out[full, col : col + rest])
        return
    for r in range(out.shape[0]):
        lo, hi = r * capacity + q0, min(r * capacity + q1, numel)
        if hi > lo:
            dst[lo:hi].copy_(out[r, col : col + hi - lo])


def _by_kind(items: list) -> list:
    """`items` split by (dtype, device) of their chunks, in first-seen order."""
    kinds: dict = {}
    for item in items:
        kinds.setdefault((item[0].dtype, item[0].device), []).append(item)
    return list(kinds.values())


def gather_into(pairs) -> None:
    """Writes the full value of every sharded EMA tensor into its target [(ema, target or
    None)]: a collective, in the same order on every rank."""
    if not pairs:
        return
    mesh = pairs[0][0].device_mesh
    items = [(local(ema), tuple(ema.shape), target) for ema, target in pairs]
    for kind in _by_kind(items):
        gather_chunks(kind, mesh.get_group(), mesh.size())


class SavedSlices:
    """Each rank's own chunk of model tensors (1/world of them), so that gathering them puts the
    whole tensors back."""

    def __init__(self, targets, group, world: int, rank: int):
        self.group, self.world = group, world
        self.items = []
        for target in targets:
            d = chunk_dim(target.shape)
            start, length = chunk(target.shape[d], world, rank) if target.dim() else (0, 1)
            part = target.narrow(d, start, length) if target.dim() else target
            own = part.clone(memory_format=torch.contiguous_format)
            self.items.append((own, target.shape, target))

    def restore(self) -> None:
        for kind in _by_kind(self.items):
            gather_chunks(kind, self.group, self.world)


def gather_full(entries, rank, cpu_offload: bool, replicated: bool = False) -> dict:
    """ema.full_state_dict(): whole, plain tensors by name; a DTensor is all-gathered (every rank
    must call), and only `rank` keeps the result (rank=None: every rank). `replicated`: the
    sharded EMA of a replicated model, gathered in buckets of its flat buffers."""
    return without_grad(_gather_full, entries, rank, cpu_offload, replicated)


def _gather_full(entries, rank, cpu_offload: bool, replicated: bool) -> dict:
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
        bound = entry.bound()
        if bound is not None and zero3.is_zero3(bound):  # a ZeRO-3 partition: every rank joins
            value = zero3.gather_full(value, bound)
        value = value.full_tensor() if is_dtensor(value) else value  # every rank joins
        if not keep:
            continue
        value = value.to("cpu") if cpu_offload else value
        if value.untyped_storage().data_ptr() == local(entry.ema).untyped_storage().data_ptr():
            value = value.clone()  # a copy, never the live EMA
        for name in entry.names:
            out[name] = value
    return out
