"""Putting EMA weights into a model's own tensors and back (ModelEma.swapped, copy_to). Same
dtype and device: the values are exchanged in place through a scratch buffer of at most
SWAP_CHUNK_BYTES per dtype and device. Otherwise (a bf16 model with a float32 EMA, an EMA on
another device, tensors sharing memory) the model's values are saved aside first. Every write is
undone if the swap-in fails part-way. A sharded EMA of a replicated model (ModelEma(shard=...))
is all-gathered straight into the model's tensors, each rank saving aside only its own chunk."""

from __future__ import annotations

import bisect
import functools

import torch

from .._dist.dtensor import copy_into, is_dtensor, local, replica_cut, same_memory
from .._dist.shard import SavedSlices, gather_into
from .._ext.grad import without_grad

#: The scratch buffer an in-place exchange uses, per dtype and device.
SWAP_CHUNK_BYTES = 16 << 20


def check_writable(pairs) -> None:
    """Refuses model tensors the EMA weights cannot be written into, before anything changes."""
    bad = [
        name
        for name, _, target in pairs
        if local(target).is_inference() and not torch.is_inference_mode_enabled()
    ]
    if bad:
        raise RuntimeError(
            f"fused_ema: {len(bad)} model tensors are inference tensors (e.g. {bad[0]}), which "
            "cannot be written outside torch.inference_mode(); nothing was changed"
        )


def _shared_storage(pairs) -> set:
    """Names of model tensors sharing memory with another tracked model tensor."""
    owners: dict = {}
    for name, _, target in pairs:
        t = local(target)
        if t.numel() == 0:
            continue
        owners.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(name)
    return {name for names in owners.values() if len(names) > 1 for name in names}


class Swap:
    """The writes of one swap-in, and how to undo them."""

    def __init__(self, pairs):
        self._gathered = [(e, t) for _, e, t in pairs if replica_cut(e, t) is not None]
        self._pairs = [p for p in pairs if replica_cut(p[1], p[2]) is None]
        self._slices = None  # the model's own chunks, while the EMA is gathered into it
        self._exchanged: list = []
        self._saved: list = []
        self._scratch: dict = {}

    def scratch_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._scratch.values())

    def saved_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for _, s in self._saved)

    def swap_in(self) -> None:
        shared = _shared_storage(self._pairs)
        try:
            without_grad(self._write_in, shared)
        except BaseException:
            self.swap_out()
            raise

    def _write_in(self, shared: set) -> None:
        if self._gathered:
            self._gather_in()
        for name, ema, target in self._pairs:
            t, e = local(target), local(ema)
            if name not in shared and _exchangeable(t, e):
                self._exchange(t, e)
                self._exchanged.append((t, e))
            else:
                self._saved.append((t, t.clone()))
                copy_into(target, ema)

    def _gather_in(self) -> None:
        mesh = self._gathered[0][0].device_mesh
        targets = [t for _, t in self._gathered]
        slices = SavedSlices(targets, mesh.get_group(), mesh.size(), mesh.get_local_rank())
        self._slices = slices  # from here on, swap_out puts the model back
        gather_into(self._gathered)

    def swap_out(self) -> None:
        """Puts the model's values back, latest write first. Resumable: a write is forgotten only
        once undone (each exchange is all or nothing, a saved copy can be written twice), so
        after an interrupt, calling it again finishes the job (ModelEma.swapped does)."""
        without_grad(self._write_out)
        self._scratch = {}

    def _write_out(self) -> None:
        slices, self._slices = self._slices, None
        if slices is not None:
            slices.restore()
        while self._exchanged:
            t, e = self._exchanged[-1]
            self._exchange(t, e)
            self._exchanged.pop()
        while self._saved:
            t, original = self._saved[-1]
            t.copy_(original)
            self._saved.pop()

    def _exchange(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.numel() == 0:
            return
        flat_a, flat_b = a.view(-1), b.view(-1)
        step = max(1, SWAP_CHUNK_BYTES // a.element_size())
        key = (a.device, a.dtype)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < min(step, a.numel()):
            scratch = self._scratch[key] = torch.empty(
                min(step, a.numel()), dtype=a.dtype, device=a.device
            )
        done = []
        try:
            for start in range(0, a.numel(), step):
                ca, cb = flat_a[start : start + step], flat_b[start : start + step]
                _exchange_chunk(ca, cb, scratch[: ca.numel()])
                done.append((ca, cb))
        except BaseException:
            for ca, cb in reversed(done):
                _exchange_chunk(ca, cb, scratch[: ca.numel()])
            raise


def _exchangeable(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.is_contiguous()
        and b.is_contiguous()
    )


def _exchange_chunk(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor) -> None:
    """a and b exchange values through scratch, all or nothing: whatever raises (a copy, or an
    interrupt landing after any of them, even the last) leaves both as they were. `copied` counts
    the copies known to be done; the next one may have run too, and is undone either way."""
    copied = 0
    try:
        scratch.copy_(a)
        copied = 1
        a.copy_(b)
        copied = 2
        b.copy_(scratch)
    except BaseException:
        if copied == 2:  # a holds b's values; b its own or a's
            b.copy_(a)
        if copied >= 1:
            a.copy_(scratch)
        raise


def check_resharding(pairs) -> None:
    """A sharded value must come from a mesh the size of the EMA's (or, for a plain EMA tensor,
    no larger than the job): anything else is a checkpoint of another world size, which only DCP
    reshards."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, value, target in pairs:
        if not is_dtensor(value):
            continue
        theirs = value.device_mesh.size()
        ours = target.device_mesh.size() if is_dtensor(target) else world
        if theirs != ours if is_dtensor(target) else theirs > world:
            here = "this EMA is sharded over" if is_dtensor(target) else "this job has"
            raise ValueError(
                f"fused_ema: {name or 'a tensor'} is a DTensor sharded over {theirs} ranks "
                f"(local shape {list(local(value).shape)}), but {here} {ours}: a sharded "
                "checkpoint saved at another "
                "world size is resharded by torch.distributed.checkpoint (state = "
                "ema.state_dict(); dcp.load(state, checkpoint_id=...); ema.load_state_dict(state)),"
                " not by torch.save/torch.load; nothing was loaded"
            )


def copy_all(pairs) -> None:
    """EMA weights into the model (copy_to), or loaded values into the EMA. Checked first. Plain
    tensors are copied by one call (torch._foreach_copy_: an interrupt lands before it or after
    it); DTensors, which may need a collective each, one by one, the remaining copies still run
    if an interrupt lands part-way. A sharded EMA of a replicated model is all-gathered into the
    model's tensors (a collective)."""
    check_resharding(pairs)
    gathered = [(e, t) for _, e, t in pairs if replica_cut(e, t) is not None]
    if gathered:
        without_grad(gather_into, gathered)
        pairs = [p for p in pairs if replica_cut(p[1], p[2]) is None]
    without_grad(_copy_each, pairs)


def _copy_each(pairs) -> None:
    plain = [(t, v) for _, v, t in pairs if not is_dtensor(t) and not is_dtensor(v)]
    if len(plain) == len(pairs):
        # A value that is its target already (a state_dict dcp.load filled in place) stays.
        plain = [(t, v) for t, v in plain if t is not v and not same_memory(t, v)]
        if plain:
            torch._foreach_copy_([t for t, _ in plain], [v for _, v in plain])
        return
    finish_all([functools.partial(copy_into, target, value) for _, value, target in pairs])


def finish_all(steps) -> None:
    """Runs every step in order even when one raises (an interrupt landing part-way): the others
    still run, then the first error propagates, so a write is never left half done. A step that
    raised, or that may have finished just before an interrupt, runs once more: steps must be
    idempotent (copies, loads of checked values)."""
    error = None
    done = 0
    retried = -1
    while done < len(steps):
        try:
            while done < len(steps):
                steps[done]()
                done += 1
        except BaseException as err:
            if error is None:
                error = err
            if retried == done:
                done += 1  # it failed twice: the others still run
            else:
                retried = done
    if error is not None:
        raise error


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
            own = local(target)
            itself = (v.data_ptr(), v.shape, v.stride(), v.dtype) == (
                own.data_ptr(),
                own.shape,
                own.stride(),
                own.dtype,
            )
            if k >= 0 and found[k][1] > start and not itself:
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
