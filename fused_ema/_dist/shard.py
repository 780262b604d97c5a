"""ModelEma(shard=...): the EMA of a model replicated across a process group (DDP), sharded as FSDP2
lays out parameters (a Shard(d) DTensor of each averaged tensor, which DCP saves and reshards), its
chunks views into one flat buffer per dtype and device, laid out alike on every rank, so that one
all-gather gathers many tensors (docs/distributed.md). Also ema.full_state_dict()'s gather_full."""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.distributed as dist
from torch import nn

from .._ext.grad import without_grad
from . import zero3
from .dtensor import chunk_dim, is_dtensor, local, own_rows

#: The bytes one bucket of a gather receives (all ranks' chunks together).
BUCKET_BYTES = 64 << 20
_ALIGN_BYTES = 64  # every chunk starts on a multiple: vector loads stay aligned
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def resolve(shard) -> ShardSpec | None:
    """The ShardSpec for ModelEma's `shard` argument (False/None: not sharded)."""
    if shard is False or shard is None:
        return None
    kind = "ProcessGroup" if shard is True else type(shard).__name__
    if type(shard) is int and dist.is_available() and shard == dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group() returns on the ranks it leaves out.
        raise ValueError(
            "fused_ema: shard= names a process group this rank is not part of (dist.new_group() "
            "returned GroupMember.NON_GROUP_MEMBER here); build the sharded EMA on the group's "
            "ranks only, with that group"
        )
    if kind not in ("ProcessGroup", "DeviceMesh"):
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
    if kind != "DeviceMesh":
        return ShardSpec(dist.group.WORLD if shard is True else shard)
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


def _chunked(own: torch.Tensor, mesh, placements, shape) -> torch.Tensor:
    """`own` as this rank's chunk of a DTensor of `shape` (contiguous strides)."""
    from torch.distributed.tensor import DTensor

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(own, mesh, placements, run_check=False, shape=shape, stride=stride)


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
        from torch.distributed.tensor import Shard

        d, start, length = own_rows(t.shape, self.world, self.rank)
        own = t.narrow(d, start, length).to(device=device, dtype=dtype)
        return _chunked(own, self.mesh(own.device), [Shard(d)], t.shape)

    def pack(self, entries: list) -> list:
        """The entries with every chunk moved into one flat buffer per dtype and device (new
        entries and tensors: the ones given are left as they were)."""
        kinds: dict = {}
        for k, e in enumerate(entries):
            if is_dtensor(e.ema):  # refuse_sharded: every DTensor here is a chunk of ours
                kinds.setdefault((local(e.ema).dtype, local(e.ema).device), []).append(k)
        out = list(entries)
        for (dtype, device), ks in kinds.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            slots, total = layout([entries[k].ema.shape for k in ks], self.world, itemsize)
            flat = torch.zeros(total, dtype=dtype, device=device)
            for k, (offset, _) in zip(ks, slots):
                e, old = entries[k], local(entries[k].ema)
                # A tensor of its own (storage offset 0): torch.save cannot save a DTensor whose
                # local tensor starts inside its storage.
                view = flat[offset : offset + old.numel()]
                view = (torch.from_dlpack(view) if view.numel() else view.clone()).view(old.shape)
                view.copy_(old)
                ema = _chunked(view, e.ema.device_mesh, e.ema.placements, e.ema.shape)
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
        problems = [
            f"rank {r}: {p}" for r in range(1, self.world) for p in _differences(every[0], every[r])
        ]
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


# Elements a checksum reads at a time: its int64 temporaries stay at 8 MB each.
_CHECKSUM_CHUNK = 1 << 20


def _checksums(tensors) -> list:
    """Per tensor, the sum of its elements' bit patterns, each times 2i + 1 (i its row-major
    index), modulo 2**64: exact, identical for identical values, and changed when elements trade
    places (a plain sum is not); one host read per device."""
    views, longest = [], {}
    for t in tensors:
        kind = _INT_OF_SIZE.get(t.element_size())
        if t.is_meta or kind is None or t.dim() == 0 and t.is_complex():
            views.append(None)
            continue
        views.append(t.detach().reshape(-1).view(kind))
        longest[t.device] = max(longest.get(t.device, 0), min(t.numel(), _CHECKSUM_CHUNK))
    odd = {d: torch.arange(n, device=d) * 2 + 1 for d, n in longest.items()}  # 1, 3, 5, ...
    sums = [None if v is None else _weighted_sum(v, odd[v.device]) for v in views]
    by_device = {}
    for s in sums:
        if s is not None:
            by_device.setdefault(s.device, []).append(s)
    values = {d: iter(torch.stack(v).tolist()) for d, v in by_device.items()}
    return [None if s is None else next(values[s.device]) for s in sums]


def _weighted_sum(bits: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """sum(bits[i] * (2i + 1)) in int64 (which wraps), chunk by chunk (`odd` holds 2i + 1 for a
    chunk): a chunk from `start` adds its own weighted sum plus 2 * start times its plain sum."""
    total = (bits[:_CHECKSUM_CHUNK] * odd[: min(len(bits), _CHECKSUM_CHUNK)]).sum(dtype=torch.int64)
    for start in range(_CHECKSUM_CHUNK, len(bits), _CHECKSUM_CHUNK):
        chunk = bits[start : start + _CHECKSUM_CHUNK]
        total += (chunk * odd[: len(chunk)]).sum(dtype=torch.int64)
        total += chunk.sum(dtype=torch.int64) * (2 * start)
    return total


def _differences(mine: list, other: list) -> list:
    """How `other` rank's signature (names, shape, dtype, checksum per tensor) differs."""
    if [t[0] for t in mine] != [t[0] for t in other]:
        a, b = ([n for t in signature for n in t[0]] for signature in (mine, other))
        extra, missing = [n for n in b if n not in set(a)], [n for n in a if n not in set(b)]
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


def gather_chunks(items: list, mesh) -> None:
    """All-gathers tensors split as ModelEma(shard=...) splits them over the 1-D `mesh`, writing
    each whole tensor into its target. `items`: [(this rank's chunk, full shape, target or None)],
    in the same order on every rank (a rank with None targets takes part without keeping
    anything). Per dtype and device of the chunks, they are laid out end to end, each with its
    longest chunk's capacity, and gathered in buckets of at most BUCKET_BYTES."""
    group, world = mesh.get_group(), mesh.size()
    kinds: dict = {}
    for item in items:
        kinds.setdefault((item[0].dtype, item[0].device), []).append(item)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for (dtype, device), kind in kinds.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        slots, total = layout([shape for _, shape, _ in kind], world, itemsize)
        step = max(1, BUCKET_BYTES // (world * itemsize))
        if device.type == "cpu" and "gloo" not in str(dist.get_backend(group)):
            device = torch.device("cuda", torch.cuda.current_device())  # NCCL: on the GPU
        send_buffer = torch.empty(min(step, total), dtype=dtype, device=device)
        out_buffer = torch.empty(world * min(step, total), dtype=dtype, device=device)
        # Each target flat: a non-contiguous one is gathered into a copy, then copied in.
        flats = [t if t is None or t.is_contiguous() else t.new_empty(t.shape) for *_, t in kind]
        flats = [t if t is None else t.view(-1) for t in flats]
        for a in range(0, total, step):
            b = min(total, a + step)
            send = send_buffer[: b - a]
            for (offset, _), (part, _, _) in zip(slots, kind):
                lo, hi = max(a, offset) - offset, min(b, offset + part.numel()) - offset
                if hi > lo:
                    send[offset + lo - a : offset + hi - a].copy_(part.reshape(-1)[lo:hi])
            out = out_buffer[: world * (b - a)]
            all_gather(out, send, group=group)
            out = out.view(world, b - a)
            for (offset, capacity), flat in zip(slots, flats):
                if flat is not None and capacity and offset < b and offset + capacity > a:
                    _copy_out(out, a, b, offset, capacity, flat)
        for (*_, target), flat in zip(kind, flats):
            if target is not None and not target.is_contiguous():
                target.copy_(flat.view(target.shape))


def _copy_out(out, a: int, b: int, offset: int, capacity: int, dst) -> None:
    """The part of one tensor that bucket [a, b) holds, into the flat `dst`: rank r's chunk is
    elements [r * capacity, (r + 1) * capacity) of the full tensor (the last ones shorter or
    empty), so the full ranks are one strided copy and the one after them a shorter one."""
    q0, q1 = max(a, offset) - offset, min(b, offset + capacity) - offset
    col = offset + q0 - a
    full = dst.numel() // capacity
    dst[: full * capacity].view(full, capacity)[:, q0:q1].copy_(out[:full, col : col + q1 - q0])
    lo, hi = full * capacity + q0, min(full * capacity + q1, dst.numel())
    if hi > lo:
        dst[lo:hi].copy_(out[full, col : col + hi - lo])


def gather_into(pairs) -> None:
    """Writes the full value of every sharded EMA tensor into its target [(ema, target or
    None)]: a collective, in the same order on every rank."""
    if pairs:
        items = [(local(ema), ema.shape, target) for ema, target in pairs]
        gather_chunks(items, pairs[0][0].device_mesh)


def gather_full(entries, rank, cpu_offload: bool, replicated: bool = False) -> dict:
    """ema.full_state_dict(): whole, plain tensors by name; a DTensor is all-gathered (every rank
    must call), and only `rank` keeps the result (rank=None: every rank). `replicated`: the
    sharded EMA of a replicated model, gathered in buckets of its flat buffers."""
    _check_rank(rank)
    return without_grad(_gather_full, entries, rank, cpu_offload, replicated)


def _check_rank(rank) -> None:
    """Refuses a `rank` no process could be (every rank raises alike, before any collective):
    each would silently get {}."""
    if rank is None:
        return
    if isinstance(rank, bool) or not hasattr(type(rank), "__index__"):
        raise TypeError(
            f"fused_ema: full_state_dict(rank=...) takes None or an int, got {type(rank).__name__}"
        )
    rank = operator.index(rank)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if rank < 0 or world is not None and rank >= world:
        within = f"0 to {world - 1}" if world is not None else "0 or more"
        raise ValueError(
            f"fused_ema: full_state_dict(rank={rank}) names no process: the ranks are {within} "
            "(rank=None keeps the result on every rank)"
        )


def _gather_full(entries, rank, cpu_offload: bool, replicated: bool) -> dict:
    distributed = dist.is_available() and dist.is_initialized()
    keep = rank is None or not distributed or dist.get_rank() == rank
    values = {}  # id(entry) -> its full value (None where this rank keeps nothing)
    replicas = [e for e in entries if replicated and is_dtensor(e.ema)]
    for e in replicas:  # ModelEma(shard=...): bucketed gathers, straight into the results
        where = "cpu" if cpu_offload else local(e.ema).device
        values[id(e)] = torch.empty(e.ema.shape, dtype=e.ema.dtype, device=where) if keep else None
    gather_into([(e.ema, values[id(e)]) for e in replicas])
    out = {}
    for entry in entries:
        if id(entry) not in values:
            value = entry.ema.detach()
            bound = entry.bound()
            if bound is not None and zero3.is_zero3(bound):  # a ZeRO-3 partition: every rank joins
                value = zero3.gather_full(value, bound)
            value = value.full_tensor() if is_dtensor(value) else value  # every rank joins
            value = value.to("cpu") if cpu_offload and keep else value
            live = local(entry.ema).untyped_storage().data_ptr()
            if keep and value.untyped_storage().data_ptr() == live:
                value = value.clone()  # a copy, never the live EMA
            values[id(entry)] = value
        if keep:
            out.update(dict.fromkeys(entry.names, values[id(entry)]))
    return out
