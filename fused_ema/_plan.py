"""How one ModelEma update runs: one fused lerp call per EMA device, the model tensors that must
first be copied next to their EMA (another device, or a dtype pair the kernel lacks) through
reusable staging buffers, and the tensors that are copied rather than averaged (integer buffers).

A plan is built when the model's structure or placement changes and reused otherwise. It keeps no
reference to the model, only weak references that tell whether the model still holds the same
tensor objects. A snapshot plan (non_blocking updates) stages every source of a CPU EMA, so the
model may change as soon as the copies have been issued.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from ._dtensor import is_dtensor, local, sharding
from .ops import SUPPORTED_DTYPE_PAIRS

# Staged views start at multiples of this many bytes, so that vector loads stay aligned.
_STAGING_ALIGN_BYTES = 64


@dataclass
class Slot:
    """One distinct tracked tensor: its EMA tensor, where its model tensor sits in the model's
    tensor walk, and whether it is averaged (float) or copied."""

    ema: torch.Tensor
    walk_index: int
    average: bool


@dataclass
class DeviceGroup:
    """The averaged slots whose EMA (its local shard, for a DTensor) lives on one device: one
    fused lerp call per update. `ema` lists the slots fed straight from plain model tensors, then
    those fed from DTensor shards, then the staged ones."""

    device: torch.device
    ema: list[torch.Tensor] = field(default_factory=list)
    direct_index: list[int] = field(default_factory=list)  # walk indices: plain model tensors
    shard_index: list[int] = field(default_factory=list)  # walk indices: DTensor model tensors
    staged_index: list[int] = field(default_factory=list)  # walk indices of the staged sources
    staging: list[torch.Tensor] = field(default_factory=list)  # where each staged source lands
    wait_for: set = field(default_factory=set)  # CUDA devices whose copies land in pinned memory

    def staged_sources(self, walk: list):
        """(staging view, model tensor) pairs: the copies to issue before the fused call."""
        return [(view, local(walk[i])) for view, i in zip(self.staging, self.staged_index)]


def _NONE():  # stands in for weakref.ref(None): a parameter registered as None
    return None


def pair_supported(ema_dtype: torch.dtype, src_dtype: torch.dtype) -> bool:
    return (ema_dtype, src_dtype) in SUPPORTED_DTYPE_PAIRS


def placement(t: torch.Tensor) -> tuple:
    return (local(t).device, t.dtype, tuple(t.shape), sharding(t))


class UpdatePlan:
    def __init__(self, slots: list[Slot], walk: list[torch.Tensor], snapshot: bool = False):
        self.slots = slots
        self.snapshot = snapshot
        self._refs = [_NONE if t is None else weakref.ref(t) for t in walk]
        self.signature = [placement(walk[s.walk_index]) for s in slots]
        # Copied (not averaged) slots, grouped by device pair for one foreach copy each.
        self.copies: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}
        self.staged_copies: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (ema, walk, view)
        self.groups: dict[torch.device, DeviceGroup] = {}
        direct: dict[torch.device, list[Slot]] = {}
        shards: dict[torch.device, list[Slot]] = {}
        staged: dict[tuple, list[Slot]] = {}
        for slot in slots:
            ema, src = local(slot.ema), local(walk[slot.walk_index])
            snap = snapshot and ema.device.type == "cpu"
            if not slot.average:
                if snap:
                    (view,) = _staging_views(
                        ema.device, src.dtype, [src.shape], pin=src.device.type == "cuda"
                    )
                    self.staged_copies.append((ema, slot.walk_index, view))
                    continue
                emas, indices = self.copies.setdefault((ema.device, src.device), ([], []))
                emas.append(ema)
                indices.append(slot.walk_index)
                continue
            device = ema.device
            self.groups.setdefault(device, DeviceGroup(device))
            if not snap and src.device == device and pair_supported(ema.dtype, src.dtype):
                sharded = is_dtensor(walk[slot.walk_index])
                (shards if sharded else direct).setdefault(device, []).append(slot)
            else:
                dtype = src.dtype if pair_supported(ema.dtype, src.dtype) else ema.dtype
                staged.setdefault((device, src.device, dtype), []).append(slot)
        for device, group_slots in direct.items():
            group = self.groups[device]
            group.ema += [local(s.ema) for s in group_slots]
            group.direct_index += [s.walk_index for s in group_slots]
        for device, group_slots in shards.items():
            group = self.groups[device]
            group.ema += [local(s.ema) for s in group_slots]
            group.shard_index += [s.walk_index for s in group_slots]
        for (device, src_device, dtype), group_slots in staged.items():
            group = self.groups[device]
            pin = device.type == "cpu" and src_device.type == "cuda"
            shapes = [local(walk[s.walk_index]).shape for s in group_slots]
            group.ema += [local(s.ema) for s in group_slots]
            group.staged_index += [s.walk_index for s in group_slots]
            group.staging += _staging_views(device, dtype, shapes, pin)
            if pin:
                group.wait_for.add(src_device)

    def sources(self, group: DeviceGroup, walk: list) -> list[torch.Tensor]:
        """The model-side tensors of a group's fused call, in the order of group.ema (staged
        sources must have been copied into group.staging first)."""
        return (
            [walk[i] for i in group.direct_index]
            + [walk[i]._local_tensor for i in group.shard_index]
            + group.staging
        )

    def matches(self, walk: list[torch.Tensor]) -> bool:
        """Whether the model holds exactly the tensor objects this plan was built for."""
        refs = self._refs
        return len(walk) == len(refs) and all(r() is t for r, t in zip(refs, walk))

    def placement_changed(self, walk: list[torch.Tensor]) -> bool:
        """Whether a tracked model tensor moved or changed dtype or shape since planning, or an
        EMA tensor was moved (through ema.module)."""
        if any(placement(walk[s.walk_index]) != p for s, p in zip(self.slots, self.signature)):
            return True
        return any(e.device != g.device for g in self.groups.values() for e in g.ema)

    @property
    def has_staging(self) -> bool:
        return any(g.staging for g in self.groups.values())

    def staging_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for g in self.groups.values() for v in g.staging)


def _staging_views(device, dtype, shapes, pin: bool) -> list[torch.Tensor]:
    """Views into one flat buffer (pinned for copies out of a GPU), each on an aligned offset."""
    align = max(1, _STAGING_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += -(-math.prod(shape) // align) * align
    flat = torch.empty(max(total, 1), dtype=dtype, device=device, pin_memory=pin)
    return [flat[o : o + math.prod(s)].view(s) for o, s in zip(offsets, shapes)]
