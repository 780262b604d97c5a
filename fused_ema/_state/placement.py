"""ModelEma.to() / .cuda() / .cpu() / .half(): the whole EMA moved to another device or floating
dtype, as if built with that device= / dtype=. Every new tensor is made first; only then are they
swapped in (the same tensor objects, so ema.module and the entries stay shared), so a failure
(out of memory, a device that is not there) changes nothing."""

from __future__ import annotations

import dataclasses

import torch

from .._dist.dtensor import is_dtensor
from .._ext.grad import outside_inference_mode
from .._model.module_view import SwappedModelView
from .._model.swap import finish_all
from .options import check_ema_dtype


def parse_to(args, kwargs):
    """nn.Module.to's arguments: (device, dtype, non_blocking), refusing what an EMA cannot do."""
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if memory_format is not None:
        raise ValueError("ema.to(memory_format=...) is not supported: the EMA keeps its layout")
    if device is not None and device.type == "meta":
        raise ValueError("ema.to('meta') would drop the average: the EMA holds values")
    if dtype is not None:
        check_ema_dtype(dtype, "ema.to()'s dtype")
    return device, dtype, non_blocking


@outside_inference_mode
def move(ema, binding, schedule, device, dtype, non_blocking: bool = False) -> None:
    """Moves every EMA tensor to `device` and every averaged one to `dtype` (None: unchanged),
    with the step counter and ema.module; all or nothing."""
    entries = binding.table.entries
    sharded = [e.name for e in entries if is_dtensor(e.ema)]
    if sharded and device is not None:
        raise ValueError(
            f"ema.to({str(device)!r}): the EMA is sharded (DTensor entries such as {sharded[0]}) "
            "and lives with its shards; gather it with ema.full_state_dict() instead"
        )
    if sharded and dtype is not None:
        raise ValueError("ema.to(dtype): a sharded (DTensor) EMA keeps the dtype it was built with")
    meta = [e.name for e in entries if e.ema.is_meta]
    if meta and device is not None:
        raise RuntimeError(
            f"ema.to(): {len(meta)} EMA tensors hold no values yet (meta, e.g. {meta[0]}); "
            "call ema.resync(model) once the model is materialised"
        )
    moves = []
    for e in entries:
        new_dtype = dtype if (dtype is not None and e.average) else e.ema.dtype
        data = e.ema.data
        moved = data.to(device=device or data.device, dtype=new_dtype, non_blocking=non_blocking)
        if moved is not data:
            moves.append((e.ema, moved))
    # ema.module's own tensors that are not EMA entries (non-persistent buffers, and tensors the
    # EMA leaves out) move with it, so that it still runs; those left out take the new dtype too
    # (the non-persistent buffers keep the model's, as when the module was built).
    extras, module, ours = [], binding.module, {id(e.ema) for e in entries}
    moving = device is not None or dtype is not None
    if moving and module is not None and not isinstance(module, SwappedModelView):
        for sub in module.modules():
            for store in (sub._parameters, sub._buffers):
                for name, t in store.items():
                    if t is not None and id(t) not in ours and not t.is_meta:
                        derived = store is sub._buffers and name in sub._non_persistent_buffers_set
                        to = dtype if dtype and t.is_floating_point() and not derived else t.dtype
                        data = t.data  # one object: .to() returns it when nothing moves
                        moved = data.to(device or data.device, to, non_blocking=non_blocking)
                        if moved is not data:
                            extras.append((sub, name, moved))
    placed = {}
    if device is not None and entries:
        target = (moves[0][1] if moves else entries[0].ema).device
        placed = schedule.placed(target if target.type != "cpu" else torch.device("cpu"))
    policy = binding.policy
    policy = dataclasses.replace(
        policy,
        device=torch.device(device) if device is not None else policy.device,
        dtype=dtype if dtype is not None else policy.dtype,
    )

    def swap_in():  # nothing here can fail: tensors swap their storage, objects are replaced
        schedule.__dict__.update(placed)
        for tensor, moved in moves:
            tensor.data = moved
        for module, name, moved in extras:
            if name in module._parameters:
                module._parameters[name].data = moved
            else:
                module._buffers[name] = moved
        binding.policy = policy
        binding.plan = None  # rebuilt for the moved tensors at the next update

    finish_all([swap_in])  # an interrupt landing in it lets it finish (it is idempotent)


class MovedByTo:
    """nn.Module's conversions for a module whose tensors move only by its own to() (ModelEma,
    and a PostHocEma's or Bema's set of them): nn.Module's go through _apply, which a parent's
    .to() / .cuda() / .half() also reaches, and which leaves the EMA where it was asked to be
    (device=None follows the model at its next update)."""

    def cuda(self, device: int | torch.device | None = None):
        return self._to_backend("cuda", torch.cuda.current_device() if device is None else device)

    def xpu(self, device: int | torch.device | None = None):
        return self._to_backend("xpu", device)

    def mtia(self, device: int | torch.device | None = None):
        return self._to_backend("mtia", device)

    def ipu(self, device: int | torch.device | None = None):
        return self._to_backend("ipu", device)

    def _to_backend(self, kind: str, device):
        """.cuda(1), .xpu(): to that backend's device (an index or a device)."""
        return self.to(
            device if isinstance(device, (torch.device, str)) else torch.device(kind, device)
        )

    def to_empty(self, *, device, recurse: bool = True):
        raise RuntimeError(
            "ema.to_empty() would drop the average (its tensors would be left uninitialised); "
            "ema.to(device) moves the EMA with its values"
        )

    def cpu(self):
        return self.to("cpu")

    def half(self):
        return self.to(torch.float16)

    def bfloat16(self):
        return self.to(torch.bfloat16)

    def float(self):
        return self.to(torch.float32)

    def double(self):
        return self.to(torch.float64)

    def type(self, dst_type):
        if not isinstance(dst_type, torch.dtype):  # nn.Module's also takes tensor type names
            raise TypeError(f"ema.type() takes a torch.dtype, as ema.to(), got {dst_type!r}")
        return self.to(dst_type)

    def _apply(self, fn, recurse=True):
        return self
