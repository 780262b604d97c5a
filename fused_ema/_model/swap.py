"""EMA weights into a model's own tensors and back (ModelEma.swapped, copy_to): prepared first (EMA
values cast where the model's dtype or device differs; scratch of at most SWAP_CHUNK_BYTES per
dtype and device), then one in-place exchange each way (csrc/swap_values.cpp). A sharded EMA of a
replicated model is all-gathered into the model's tensors, each rank saving aside its own chunk."""

from __future__ import annotations

import bisect
import functools

import torch

from .._dist import zero3
from .._dist.dtensor import copy_into, is_dtensor, local, replica_cut, same_memory, sharding
from .._dist.shard import gather_chunks, gather_into
from .._ext.grad import outside_inference_mode, without_grad
from .._ext.loader import _C
from ..errors import CheckpointError
from ..ops import storage_shortfall

#: The scratch buffer an in-place exchange uses, per dtype and device.
SWAP_CHUNK_BYTES = 16 << 20


def check_writable(pairs) -> None:
    """Refuses model tensors the EMA weights cannot be written into, before anything changes."""
    expanded = [name for name, _, t in pairs if any(s == 0 < n - 1 for n, s in _dims(local(t)))]
    if expanded:
        raise ValueError(
            f"fused_ema: the model's tensors {', '.join(expanded)} repeat one memory location "
            "along a dimension (made by expand()?), which the EMA's values cannot be written "
            "into: give the model its own copy (.clone()); nothing was changed"
        )
    if torch.is_inference_mode_enabled():
        return
    bad = [name for name, _, target in pairs if local(target).is_inference()]
    if bad:
        raise RuntimeError(
            f"fused_ema: {len(bad)} model tensors are inference tensors (e.g. {bad[0]}), which "
            "cannot be written outside torch.inference_mode(); nothing was changed"
        )


def _dims(t: torch.Tensor):
    return zip(t.shape, t.stride()) if t.layout == torch.strided else ()


class Swap:
    """One swap of (name, EMA tensor, model tensor) pairs, prepared: swap_in() and swap_out() are
    one exchange each, and either may be called again after an interrupt (it then does nothing
    more). Tensors sharing memory need no care: each exchange undoes itself, in reverse order."""

    @outside_inference_mode  # entered under the mode, perhaps left outside it
    def __init__(self, pairs):
        self._gathered = [(e, t) for _, e, t in pairs if replica_cut(e, t) is not None]
        self._slices = None  # this rank's chunks of the model's tensors, while the EMA is in
        pairs = [p for p in pairs if replica_cut(p[1], p[2]) is None]
        self._zero3 = [t for _, _, t in pairs if zero3.is_zero3(t)]  # released at both ends
        # A ZeRO-3 parameter exchanges its valid partition, which a forward gathers once released.
        pairs = [(n, e, zero3.partition(t) if zero3.is_zero3(t) else t) for n, e, t in pairs]
        self._partners = without_grad(lambda: [_partner(e, t) for _, e, t in pairs])
        self._targets = [local(t) for _, _, t in pairs]
        self._names = [n for n, _, _ in pairs]
        self.changed: list = []  # the model tensors swap_out could not give their values back
        need: dict = {}  # scratch per dtype and device: SWAP_CHUNK_BYTES at most, a row at least
        for t in self._targets:
            row = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 1
            chunk = min(max(1, SWAP_CHUNK_BYTES // t.element_size()), t.numel())
            need[t.device, t.dtype] = max(need.get((t.device, t.dtype), 0), chunk, row)
        self._scratch = [torch.empty(n, dtype=dt, device=d) for (d, dt), n in need.items()]
        self._state = torch.zeros((), dtype=torch.int64)  # 1 while the EMA's values are in

    def swap_in(self) -> None:
        if self._gathered and self._slices is None:
            contiguous = torch.contiguous_format
            self._slices = [  # swap_out gathers them back into the model's tensors
                (t.narrow(*replica_cut(e, t)).clone(memory_format=contiguous), t.shape, t)
                for e, t in self._gathered
            ]
            without_grad(gather_into, self._gathered)
        zero3.release(self._zero3)  # a forward then gathers the partitions holding the EMA
        _swap_values(self._targets, self._partners, self._scratch, self._state, 1)

    def swap_out(self) -> None:
        """Puts the model's values back. A call interrupted before its exchange may be repeated.
        A model tensor the block changed (`.data =` of another shape or dtype, freed memory) has
        lost the EMA values it held: the others are put back, then a ValueError names it."""
        pairs = list(zip(self._names, self._targets, self._partners))
        changed = self.changed = [n for n, t, p in pairs if not _exchangeable(t, p)]
        kept = [(t, p) for n, t, p in pairs if n not in changed][::-1]
        _swap_values([t for t, _ in kept], [p for _, p in kept], self._scratch, self._state, 0)
        zero3.release(self._zero3)  # what a forward gathered of the EMA inside the block
        if self._slices is not None:
            without_grad(gather_chunks, self._slices, self._gathered[0][0].device_mesh)
            self._slices = None
        if changed:
            raise ValueError(
                f"fused_ema: swapped(): the model's {', '.join(changed)} changed inside the block "
                "(its shape, dtype, device or memory), so the EMA values it held are lost: the "
                "EMA keeps the model's values from the block's start for it; every other tensor "
                "was put back"
            )


def _swap_values(a, b, scratch, state, into: int) -> None:
    without_grad(torch.ops.fused_ema.swap_values_, a, b, scratch, state, into)


def _exchangeable(target: torch.Tensor, partner: torch.Tensor) -> bool:
    """Whether the model tensor still is what its partner was made for, with its memory."""
    kind = (target.shape, target.dtype, target.device)
    return kind == (partner.shape, partner.dtype, partner.device) and not storage_shortfall(target)


def _partner(ema: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """What the model tensor exchanges values with: the EMA tensor itself, or a copy of it in
    the model tensor's dtype, device and layout."""
    same_kind = is_dtensor(ema) == is_dtensor(target)
    if same_kind and (not is_dtensor(ema) or sharding(ema) == sharding(target)):
        e, t = local(ema), local(target)
        if (e.dtype, e.device, e.shape) == (t.dtype, t.device, t.shape):
            return e
    value = torch.empty_like(target)
    copy_into(value, ema)
    return local(value)


def check_resharding(pairs) -> None:
    """A sharded value must come from a mesh the size of the EMA's (or, for a plain EMA tensor,
    no larger than the job): anything else is a checkpoint of another world size, which only DCP
    reshards."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, value, target in pairs:
        if not is_dtensor(value) or value is target or same_memory(local(value), local(target)):
            continue  # (the EMA's own tensors, which dcp.load filled in place, are its shards)
        mesh = value.device_mesh
        theirs = mesh.size()
        ours = target.device_mesh.size() if is_dtensor(target) else world
        # A mesh torch.load rebuilt in a job of another size takes groups of this job's size.
        foreign = any(mesh.get_group(d).size() != mesh.size(d) for d in range(mesh.ndim))
        if foreign or (theirs != ours if is_dtensor(target) else theirs > world):
            here = "this EMA is sharded over" if is_dtensor(target) else "this job has"
            raise CheckpointError(
                [
                    f"{name or 'a tensor'} is a DTensor sharded over {theirs} ranks "
                    f"(local shape {list(local(value).shape)}), but {here} {ours}: a sharded "
                    "checkpoint saved at another world size is resharded by torch.distributed."
                    "checkpoint (state = ema.state_dict(); dcp.load(state, checkpoint_id=...); "
                    "ema.load_state_dict(state)), not by torch.save/torch.load"
                ]
            )
        # torch.load rebuilds a mesh with the coordinate of the rank that saved it.
        saved = mesh.get_coordinate()
        here = tuple(dist.get_rank(mesh.get_group(d)) for d in range(mesh.ndim))
        if saved is not None and tuple(saved) != here:
            raise CheckpointError(
                [
                    f"{name or 'a tensor'} is the shard of rank {list(saved)} of its DTensor's "
                    f"mesh, and this process is {list(here)} there: torch.save of a rank's "
                    "state_dict() reloads only on the rank that saved it (torch.distributed."
                    "checkpoint reloads on any)"
                ]
            )


def copy_all(pairs) -> None:
    """EMA weights into the model (copy_to), or the model's or loaded values into the EMA, as
    checked by the caller (Binding.pairs_with, commit_loads), autograd off. Plain tensors are
    copied by one call (torch._foreach_copy_: an interrupt lands before it or after it); DTensors,
    which may need a collective each, one by one, the rest still running if an interrupt lands
    part-way. A sharded EMA of a replicated model is all-gathered into the model (a collective)."""
    without_grad(_copy_all, pairs)


def _copy_all(pairs) -> None:
    partitioned = [(e, t) for _, e, t in pairs if zero3.is_zero3(t)]
    if partitioned:  # a DeepSpeed ZeRO-3 model: each rank writes its partitions
        steps = [functools.partial(zero3.write, e, t) for e, t in partitioned]
        finish_all(steps + [lambda: zero3.release([t for _, t in partitioned])])
        pairs = [p for p in pairs if not zero3.is_zero3(p[2])]
    gathered = [(e, t) for _, e, t in pairs if replica_cut(e, t) is not None]
    if gathered:
        gather_into(gathered)
        pairs = [p for p in pairs if replica_cut(p[1], p[2]) is None]
    plain = [(t, v) for _, v, t in pairs if not is_dtensor(t) and not is_dtensor(v)]
    if len(plain) < len(pairs):
        return finish_all([functools.partial(copy_into, t, v) for _, v, t in pairs])
    # A value that is its target already (a state_dict dcp.load filled in place) stays.
    plain = [(t, v) for t, v in plain if t is not v and not same_memory(t, v)]
    if plain:
        torch._foreach_copy_([t for t, _ in plain], [v for _, v in plain])


# finish_all(steps): every step run in order to its end, in C (csrc/finish_all.cpp) so that no
# Python code runs between them: one interrupted runs again (up to 16 times: an interrupt the
# step raises itself must not loop forever), one that fails once more, then the next runs, and
# the first error is raised after the last. Steps are idempotent.
finish_all = _C.finish_all


def unaliased(pairs) -> list:
    """(name, value, target) pairs whose values share memory with a target other than their own
    (a checkpoint made of the EMA's own tensors under other names) copied first, so every copy
    reads the value as it was when the load began."""
    spans: dict[torch.device, list[tuple[int, int]]] = {}
    for _, _, target in pairs:
        t = local(target)
        if t.numel() > 0:
            spans.setdefault(t.device, []).append(_span(t))
    for found in spans.values():
        found.sort()
    out = []
    for name, value, target in pairs:
        v = local(value)
        found = spans.get(v.device)
        if found and v.numel() > 0:
            start, end = _span(v)
            k = bisect.bisect_left(found, (end, end)) - 1
            if k >= 0 and found[k][1] > start and not same_memory(v, local(target)):
                value = value.clone()
        out.append((name, value, target))
    return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a tensor's elements may occupy: from its lowest to past its highest address."""
    low = high = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * t.element_size()
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low, high + t.element_size()
