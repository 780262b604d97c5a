"""One ModelEma update, planned for one walk of the model (weakly) and run in every mode while the
model matches it: a fused lerp per EMA device, sources on another device or of a dtype pair the
kernel lacks staged in reusable buffers, unaveraged tensors copied. All or nothing: every check
comes before the first write, and an interrupt after it lets the update finish, then propagates."""

from __future__ import annotations

import copy
import math
import operator
import weakref
import zlib
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from .._dist import zero3
from .._dist.dtensor import is_dtensor, local, replica_cut, shard_offset
from .._ext.loader import _C
from .._model.tracking import EntryTable
from ..ops import SUPPORTED_DTYPE_PAIRS, bema_, lerp_, lerp_many_, lerp_stochastic_

# Staged views start at multiples of this many bytes, so that vector loads stay aligned.
_STAGING_ALIGN_BYTES = 64


def taker(indices: tuple):
    """A function of a walk returning [walk[i] for i in indices], as one C loop of
    operator.itemgetter."""
    if not indices:
        return lambda walk: []
    get = operator.itemgetter(*indices)
    if len(indices) == 1:  # itemgetter of one index returns the item itself
        return lambda walk: [get(walk)]
    return lambda walk: list(get(walk))


def take(walk: list, indices: tuple) -> list:
    return taker(indices)(walk)


def walk_signature(walk: list) -> list:
    """What a plan relies on in each walk item besides its identity, which `.data =`, `resize_` or
    `.to()` can change: its Python type, dtype, layout, device and shape (None stays None)."""
    return [None if t is None else (type(t), t.dtype, t.layout, t.device, t.shape) for t in walk]


@dataclass
class DeviceGroup:
    """The averaged entries whose EMA (its local shard, for a DTensor) lives on one device: one
    fused lerp call per update. `ema` lists the entries fed straight from plain model tensors,
    then those fed from DTensor shards, then the staged ones."""

    device: torch.device
    ema: list = field(default_factory=list)
    direct: tuple = ()  # walk indices of plain model tensors
    shards: list = field(default_factory=list)  # walk indices of DTensor model tensors
    cuts: list = field(default_factory=list)  # (walk index, dim, start, length): a replica's rows
    staged: list = field(default_factory=list)  # (walk index, cut or None) of staged sources
    staging: list = field(default_factory=list)  # where each staged source lands
    wait_for: set = field(default_factory=set)  # CUDA devices whose copies land in pinned memory
    # Stochastic rounding of 16-bit EMAs: the seed (None: round to nearest), and per EMA tensor
    # its generator key and the index of its first element in the full tensor.
    seed: int | None = None
    keys: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    whole: bool = False  # the sources are the walk itself: every item, in order, direct
    # A joined plan (UpdatePlan.joined): the groups of the other EMAs updated from these same
    # sources, with one weight each after this group's, and how: "lerp_many" (ops.lerp_many_)
    # or "bema" (ops.bema_: this group is BEMA's EMA, the followers theta0 and the correction).
    followers: tuple = ()
    joint: str = "lerp_many"

    def lerp(self, sources: list, weight: torch.Tensor, step: torch.Tensor) -> None:
        if not weight.is_cpu and weight.device != self.device:
            weight = weight.to(self.device)  # a device weight for another device
        if self.followers:
            self._lerp_many(sources, weight, step)
            return
        if self.seed is None:
            lerp_(self.ema, sources, weight)
            return
        if not step.is_cpu and step.device != self.device:
            step = step.to(self.device)
        lerp_stochastic_(
            self.ema,
            sources,
            weight,
            seed=self.seed,
            step=step,
            keys=self.keys,
            offsets=self.offsets,
        )

    def _lerp_many(self, sources: list, weights: torch.Tensor, step: torch.Tensor) -> None:
        groups = (self, *self.followers)
        emas = [g.ema for g in groups]
        if self.joint == "bema":
            bema_(*emas, sources, weights)  # no stochastic rounding: Bema rounds to nearest
            return
        if self.seed is None:
            lerp_many_(emas, sources, weights)
            return
        if not step.is_cpu and step.device != self.device:
            step = step.to(self.device)
        lerp_many_(
            emas,
            sources,
            weights,
            seed=[g.seed for g in groups],
            step=step,
            keys=[g.keys for g in groups],
            offsets=self.offsets,
        )

    def joined(self, others: list, joint: str = "lerp_many") -> DeviceGroup:
        """This group updating the groups `others` too, from its sources: theirs must list EMA
        tensors for the same sources, in the same order (plans of one walk, one policy)."""
        for other in others:
            same = (other.direct, other.shards, other.cuts, other.staged, other.offsets)
            if same != (self.direct, self.shards, self.cuts, self.staged, self.offsets) or (
                (other.seed is None) != (self.seed is None)
            ):
                raise RuntimeError(
                    f"fused_ema: the EMAs updated together place their tensors on {self.device} "
                    "differently (another dtype or device policy): they cannot share one pass"
                )
        return replace(self, followers=tuple(others), joint=joint)

    def sources(self, walk: list) -> list:
        if self.whole:
            return walk
        out = self._take(walk)
        if self.shards:
            out += [walk[i]._local_tensor for i in self.shards]
        if self.cuts:
            out += [zero3.base(walk[i]).narrow(d, s, n) for i, d, s, n in self.cuts]
        return out + self.staging

    @cached_property
    def _take(self):
        """taker(self.direct), built once (direct is set before the first update)."""
        return taker(self.direct)

    def staged_copies(self, walk: list) -> list:
        return [(view, _part(walk[i], cut)) for view, (i, cut) in zip(self.staging, self.staged)]


@dataclass
class CopyGroup:
    """Unaveraged entries (integer buffers, buffers="copy") between one pair of devices."""

    ema: list = field(default_factory=list)
    index: list = field(default_factory=list)
    staging: list = field(default_factory=list)  # snapshot plans: where CPU copies land first


class UpdatePlan:
    def __init__(
        self, table: EntryTable, walk: list, names: int, snapshot: bool = False, seed=None
    ):
        self.snapshot = snapshot
        self.names = names  # the walk's hash of every module, parameter and buffer name
        self.refs = tuple(None if t is None else weakref.ref(t) for t in walk)
        self.signature = walk_signature(walk)
        position: dict = {}
        for i, t in enumerate(walk):
            position.setdefault(id(t), i)
        self.groups: dict[torch.device, DeviceGroup] = {}
        self.copies: dict[tuple, CopyGroup] = {}
        direct: dict = {}
        shards: dict = {}
        cuts: dict = {}
        staged: dict = {}
        streams: dict = {}
        firsts: dict = {}  # id(EMA tensor) -> index of its first element in the full tensor
        for entry in table.entries:
            index = position[id(entry.bound())]
            ema, src = local(entry.ema), local(walk[index])
            snap = snapshot and ema.device.type == "cpu"
            if not entry.average:
                src = zero3.copied(walk[index])
                group = self.copies.setdefault((ema.device, src.device, snap), CopyGroup())
                group.ema.append(ema)
                group.index.append(index)
                if snap:
                    pin = src.device.type == "cuda"
                    group.staging += _staging_views(ema.device, src.dtype, [src.shape], pin)
                continue
            device = ema.device
            self.groups.setdefault(device, DeviceGroup(device))
            if zero3.is_zero3(walk[index]):  # a ZeRO-3 parameter: its partition's valid part
                cut = zero3.cut(walk[index])
                src = _part(walk[index], cut)
                firsts[id(ema)] = zero3.offset(walk[index])
            else:
                cut = replica_cut(entry.ema, walk[index])  # ModelEma(shard=...): its rows only
                firsts[id(ema)] = shard_offset(entry.ema, 0) if is_dtensor(entry.ema) else 0
            supported = (ema.dtype, src.dtype) in SUPPORTED_DTYPE_PAIRS
            if not snap and src.device == device and supported:
                if cut is not None:
                    cuts.setdefault(device, []).append((ema, (index, *cut)))
                else:
                    bucket = shards if is_dtensor(walk[index]) else direct
                    bucket.setdefault(device, []).append((ema, index))
            else:
                dtype = src.dtype if supported else ema.dtype
                staged.setdefault((device, src.device, dtype), []).append((ema, (index, cut)))
            streams[id(ema)] = entry
        for device, group in self.groups.items():  # plain sources, then shards, then cuts
            fed = [bucket.get(device, []) for bucket in (direct, shards, cuts)]
            group.ema += [e for items in fed for e, _ in items]
            plain, group.shards, group.cuts = ([i for _, i in items] for items in fed)
            group.direct = tuple(plain)
            group.whole = group.direct == tuple(range(len(walk)))
        for (device, src_device, dtype), items in staged.items():
            group = self.groups[device]
            pin = device.type == "cpu" and src_device.type == "cuda"
            shapes = [_part(walk[i], cut).shape for _, (i, cut) in items]
            group.ema += [e for e, _ in items]
            group.staged += [i for _, i in items]
            group.staging += _staging_views(device, dtype, shapes, pin)
            if pin:
                group.wait_for.add(src_device)
        for group in self.groups.values():
            if seed is not None and any(e.dtype in _ROUNDED for e in group.ema):
                group.seed = seed
                group.keys = [stream_key(streams[id(e)].name) for e in group.ema]
                group.offsets = [firsts[id(e)] for e in group.ema]
        # One EMA tensor per write: its version counter moves when that write happens.
        self._probes = [g.ema[0] for g in self.groups.values()]
        self._probes += [c.ema[0] for c in self.copies.values()]
        self.marks: list | None = None  # the probes' versions as the latest run began
        self._walk_cache = None  # what the walk read, once a model matched this plan
        self._joined = None  # (the other plans, the plan joined with them), from joined()

    def joined(self, others: list, how: str = "lerp_many") -> UpdatePlan:
        """A plan that runs this one and `others` (plans of the same walk, for other EMAs of the
        model) as one update: each device's sources are staged and read once for every EMA
        (ops.lerp_many_), each plan's copies run, and it is all or nothing across them. It
        runs with one weight per plan, this one's first."""
        cached = self._joined
        if cached is not None and len(cached[0]) == len(others):
            if all(a is b for a, b in zip(cached[0], others)):
                return cached[1]
        joint = copy.copy(self)
        joint._joined = None
        joint.groups = {}
        for device, group in self.groups.items():
            theirs = [p.groups.get(device) for p in others]
            if any(g is None for g in theirs) or any(
                set(p.groups) != set(self.groups) for p in others
            ):
                raise RuntimeError(
                    "fused_ema: the EMAs updated together keep their tensors on different "
                    "devices: they cannot share one pass"
                )
            joint.groups[device] = group.joined(theirs, how)
        joint.copies = {}
        for k, plan in enumerate((self, *others)):
            for key, group in plan.copies.items():
                joint.copies[(k, *key)] = group
        joint._probes = [g.ema[0] for g in joint.groups.values()]
        joint._probes += [c.ema[0] for c in joint.copies.values()]
        joint.marks = None
        self._joined = (tuple(others), joint)
        return joint

    # ------------------------------------------------------------------ checks

    def remember(self, model, walk: list, with_buffers: bool) -> None:
        """Records, after `walk` of `model` matched this plan, what the walk read (every
        module's dicts and their versions), so that later updates can skip walking it."""
        self._walk_cache = _C.walk_cache(model, with_buffers, walk)

    def unchanged_walk(self, model) -> list | None:
        """The walk of `model` if no dict the remembered walk read has changed since: then the
        model holds this plan's tensor objects under its names (same_tensors() tells whether
        they still hold what it was built for). None when that cannot be told without walking."""
        cache = self._walk_cache
        return None if cache is None else _C.walk_unchanged(cache, model)

    def matches(self, walk: list, names: int) -> bool:
        """Whether the model holds exactly the tensor objects this plan was built for, under the
        same names."""
        return names == self.names and _C.walk_matches(walk, self.refs)

    def same_tensors(self, walk: list) -> bool:
        """Whether the walk's tensors (this plan's objects) keep their types, dtypes, layouts,
        devices and shapes."""
        return walk_signature(walk) == self.signature

    @property
    def has_staging(self) -> bool:
        return any(g.staging for g in self.groups.values())

    def staging_bytes(self) -> int:
        views = [v for g in self.groups.values() for v in g.staging]
        views += [v for c in self.copies.values() for v in c.staging]
        return sum(v.numel() * v.element_size() for v in views)

    def started(self) -> bool:
        """Whether the run begun last has written anything."""
        marks = self.marks
        return marks is not None and any(p._version != m for p, m in zip(self._probes, marks))

    # ------------------------------------------------------------------ running

    def run(self, walk: list, weight, step, sources: list | None = None) -> None:
        """The whole update, blocking, with `weight` (one per plan of a joined plan) and `step`.
        `sources` (the walk's values, from a traced program) replaces the model's tensors as what
        is averaged toward."""
        values = walk if sources is None else sources
        self.marks = [p._version for p in self._probes]
        copies = [(lambda c=c: self._copy(c, values), c.ema[0]) for c in self.copies.values()]
        if self.has_staging and _zero_on_host(weight):
            # Cross-device copies are not free: skip them on the steps update_every leaves out.
            # (Same-device updates never read the weight in Python.)
            _run_to_the_end(copies)
            return
        self._stage(self.groups.values(), values)
        lerps = [
            (lambda g=g: g.lerp(g.sources(values), weight, step), g.ema[0])
            for g in self.groups.values()
        ]
        _run_to_the_end(lerps + copies)

    def start(self, walk: list, weight, step, runner) -> bool:
        """A non_blocking update: device EMAs update in stream order now; the copies for a CPU
        EMA are issued on side streams and a worker thread averages once they have landed.
        Returns whether work was left to the worker. That job is prepared before anything is
        written, so a caller interrupted anywhere can settle it (AsyncRunner.settle)."""
        self.marks = [p._version for p in self._probes]
        skipped = _zero_on_host(weight)
        now = [g for g in self.groups.values() if g.device.type != "cpu"]
        later = [g for g in self.groups.values() if g.device.type == "cpu" and not skipped]
        snapped = [c for c in self.copies.values() if c.staging]
        self._stage(now, walk)
        writes = [(lambda g=g: g.lerp(g.sources(walk), weight, step), g.ema[0]) for g in now]
        writes += [
            (lambda c=c: self._copy(c, walk), c.ema[0])
            for c in self.copies.values()
            if not c.staging
        ]
        pairs = [pair for g in later for pair in g.staged_copies(walk)]
        pairs += [(v, zero3.copied(walk[i])) for c in snapped for v, i in zip(c.staging, c.index)]
        if pairs:
            events = runner.issue_copies(pairs)
            later_writes = [(lambda g=g: g.lerp(g.staging, weight, step), g.ema[0]) for g in later]
            later_writes += [
                (lambda c=c: torch._foreach_copy_(c.ema, c.staging), c.ema[0]) for c in snapped
            ]

            def finish():
                for event in events:
                    event.synchronize()
                _run_to_the_end(later_writes)

            runner.prepare(finish)
        _run_to_the_end(writes)
        if pairs:
            runner.launch()
        return bool(pairs)

    def _stage(self, groups, values: list) -> None:
        """Copies staged sources into place; nothing of the EMA is written yet."""
        waits, views, parts = set(), [], []
        for group in groups:
            views += group.staging
            parts += [_part(values[i], cut) for i, cut in group.staged]
            waits |= group.wait_for
        if views:
            torch._foreach_copy_(views, parts, non_blocking=True)
        for cuda_device in waits:
            # copies into pinned host memory must land before the CPU kernel reads them
            torch.cuda.current_stream(cuda_device).synchronize()

    @staticmethod
    def _copy(group: CopyGroup, values: list) -> None:
        torch._foreach_copy_(group.ema, [zero3.copied(values[i]) for i in group.index])


_ROUNDED = (torch.bfloat16, torch.float16)


def _zero_on_host(weight: torch.Tensor) -> bool:
    """Whether the weights (one per EMA of the update) are CPU values that are all 0."""
    return weight.device.type == "cpu" and not bool(weight.any())


def stream_key(name: str) -> int:
    """The random stream of an EMA tensor: a 31-bit hash of its name, the same on every rank,
    device and list order."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _part(t: torch.Tensor, cut) -> torch.Tensor:
    """What an EMA tensor averages of model tensor `t`: its local shard, or its rows `cut` (of
    its partition, for a ZeRO-3 parameter)."""
    return local(t) if cut is None else zero3.base(t).narrow(*cut)


def _run_to_the_end(writes: list) -> None:
    """Runs every (write, probe) pair. If one raises after an earlier one wrote (an interrupt
    arriving once a kernel has returned), the writes that have not happened still run and the
    error propagates after: the EMA never holds half an update. A write has happened when the
    version counter of its probe, an EMA tensor it writes, has moved."""
    marks = [probe._version for _, probe in writes]
    try:
        for write, _ in writes:
            write()
    except BaseException:
        moved = [probe._version != mark for (_, probe), mark in zip(writes, marks)]
        if not any(moved):
            raise
        for (write, _), happened in zip(writes, moved):
            if not happened:
                write()
        raise


def _staging_views(device, dtype, shapes, pin: bool) -> list[torch.Tensor]:
    """Views into one flat buffer (pinned for copies out of a GPU), each on an aligned offset."""
    align = max(1, _STAGING_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += -(-math.prod(shape) // align) * align
    flat = torch.empty(max(total, 1), dtype=dtype, device=device, pin_memory=pin)
    return [flat[o : o + math.prod(s)].view(s) for o, s in zip(offsets, shapes)]
