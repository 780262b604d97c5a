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
from ..ops import SUPPORTED_DTYPE_PAIRS, bema_, lerp_, lerp_many_, lerp_stochastic_, refuse_freed

# The fused call a device group makes (DeviceGroup.kind; csrc/prepared_update.h's FusedKind).
LERP, LERP_STOCHASTIC, LERP_MANY, LERP_MANY_STOCHASTIC, BEMA = range(5)
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

    @property
    def kind(self) -> int:
        """The fused call this group makes: LERP, LERP_STOCHASTIC, LERP_MANY,
        LERP_MANY_STOCHASTIC or BEMA (no stochastic rounding: Bema rounds to nearest)."""
        if self.joint == "bema":
            return BEMA
        return (LERP_MANY if self.followers else LERP) + (self.seed is not None)

    def write(self, values: list, weight, step, landed: bool = False) -> None:
        """The lerp toward the walk's `values`, or (`landed`) toward the staging they landed in."""
        sources = self.staging if landed else self.sources(values)
        if not weight.is_cpu and weight.device != self.device:
            weight = weight.to(self.device)  # a device weight for another device
        groups, kind = (self, *self.followers), self.kind
        if kind == BEMA:
            bema_(*(g.ema for g in groups), sources, weight)
        elif kind == LERP:
            lerp_(self.ema, sources, weight)
        elif kind == LERP_MANY:
            lerp_many_([g.ema for g in groups], sources, weight)
        else:
            if not step.is_cpu and step.device != self.device:
                step = step.to(self.device)
            if kind == LERP_STOCHASTIC:
                fused, emas, seed, keys = lerp_stochastic_, self.ema, self.seed, self.keys
            else:
                fused, emas = lerp_many_, [g.ema for g in groups]
                seed, keys = [g.seed for g in groups], [g.keys for g in groups]
            fused(emas, sources, weight, seed=seed, step=step, keys=keys, offsets=self.offsets)

    def joined(self, others: list, joint: str = "lerp_many") -> DeviceGroup:
        """This group updating the groups `others` too, from its sources: theirs must list EMA
        tensors for the same sources, in the same order (plans of one walk, one policy)."""

        def layout(g):
            return g.direct, g.shards, g.cuts, g.staged, g.offsets, g.seed is None

        if any(layout(other) != layout(self) for other in others):
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

    def staged_copies(self, walk: list) -> list:
        return [(view, zero3.copied(walk[i])) for view, i in zip(self.staging, self.index)]

    def write(self, values: list, weight, step, landed: bool = False) -> None:
        """Copies the walk's `values`, or (`landed`) the staging they landed in."""
        src = self.staging if landed else [zero3.copied(values[i]) for i in self.index]
        torch._foreach_copy_(self.ema, src)


class UpdatePlan:
    def __init__(
        self, table: EntryTable, walk: list, names: int, snapshot: bool = False, seed=None
    ):
        self.snapshot = snapshot
        # EMA tensors made from a meta-device model: nothing to update until a resync.
        self.meta = [e.name for e in table.entries if e.ema.is_meta]
        self.names = names  # the walk's hash of every module, parameter and buffer name
        self.refs = tuple(None if t is None else weakref.ref(t) for t in walk)
        self.signature = walk_signature(walk)
        # Only ema.to() converts EMA tensors, and it drops the plan: a dtype that moved since is
        # a conversion behind the EMA's back (ema.module.half()), refused by converted().
        self._emas = [e.ema for e in table.entries]
        self._ema_dtypes = [t.dtype for t in self._emas]
        position = {id(t): i for i, t in reversed(list(enumerate(walk)))}  # first occurrences
        self.groups: dict[torch.device, DeviceGroup] = {}
        self.copies: dict[tuple, CopyGroup] = {}
        fed: dict = {}  # (device, 0 plain / 1 DTensor / 2 rows) -> [(EMA tensor, source)]
        staged: dict = {}
        # id(EMA tensor) -> (its name, the index of its first element in the full tensor)
        rounding: dict = {}
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
                first = zero3.offset(walk[index])
            else:
                cut = replica_cut(entry.ema, walk[index])  # ModelEma(shard=...): its rows only
                first = shard_offset(entry.ema, f"the EMA's {entry.name}")
            rounding[id(ema)] = (entry.name, first)
            supported = (ema.dtype, src.dtype) in SUPPORTED_DTYPE_PAIRS
            if not snap and src.device == device and supported:
                kind = 2 if cut is not None else int(is_dtensor(walk[index]))
                item = index if cut is None else (index, *cut)
                fed.setdefault((device, kind), []).append((ema, item))
            else:
                dtype = src.dtype if supported else ema.dtype
                staged.setdefault((device, src.device, dtype), []).append((ema, (index, cut)))
        for device, group in self.groups.items():  # plain sources, then shards, then cuts
            items = [fed.get((device, kind), []) for kind in range(3)]
            group.ema += [e for kind in items for e, _ in kind]
            plain, group.shards, group.cuts = ([i for _, i in kind] for kind in items)
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
                group.keys = [stream_key(rounding[id(e)][0]) for e in group.ema]
                group.offsets = [rounding[id(e)][1] for e in group.ema]
        self.marks: list | None = None  # versions() as the latest run began
        self._walk_cache = None  # what the walk read, once a model matched this plan
        self._joined = None  # (the other plans, the plan joined with them), from joined()

    def joined(self, others: list, how: str = "lerp_many") -> UpdatePlan:
        """A plan that runs this one and `others` (plans of the same walk, for other EMAs of the
        model) as one update: each device's sources are staged and read once for every EMA
        (ops.lerp_many_), each plan's copies run, and it is all or nothing across them. It
        runs with one weight per plan, this one's first."""
        if self._joined is not None and self._joined[0] == tuple(others):  # plans by identity
            return self._joined[1]
        if any(set(p.groups) != set(self.groups) for p in others):
            raise RuntimeError(
                "fused_ema: the EMAs updated together keep their tensors on different "
                "devices: they cannot share one pass"
            )
        joint = copy.copy(self)
        joint._joined, joint.marks = None, None
        joint.groups = {
            d: g.joined([p.groups[d] for p in others], how) for d, g in self.groups.items()
        }
        joint.copies = {
            (k, *key): group
            for k, plan in enumerate((self, *others))
            for key, group in plan.copies.items()
        }
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

    def converted(self, table: EntryTable) -> list[str]:
        """The EMA tensors of `table` converted to another dtype since this plan was made."""
        if [t.dtype for t in self._emas] == self._ema_dtypes:
            return []
        was = {id(t): d for t, d in zip(self._emas, self._ema_dtypes)}
        return [
            f"{e.name} ({e.ema.dtype}, averaged in {was[id(e.ema)]})"
            for e in table.entries
            if was.get(id(e.ema), e.ema.dtype) != e.ema.dtype
        ]

    def same_tensors(self, walk: list) -> bool:
        """Whether the walk's tensors (this plan's objects) keep their types, dtypes, layouts,
        devices and shapes."""
        return walk_signature(walk) == self.signature

    @property
    def has_staging(self) -> bool:
        return any(g.staging for g in self.groups.values())

    def versions(self) -> list:
        """The version counter of one EMA tensor per write (it moves when that write happens)."""
        return [g.ema[0]._version for g in (*self.groups.values(), *self.copies.values())]

    def started(self) -> bool:
        """Whether the run begun last has written anything."""
        return self.marks is not None and self.versions() != self.marks

    # ------------------------------------------------------------------ running

    def run(self, walk: list, weight, step, sources: list | None = None) -> None:
        """The whole update, blocking, with `weight` (one per plan of a joined plan) and `step`.
        `sources` (the walk's values, from a traced program) replaces the model's tensors as what
        is averaged toward."""
        values = walk if sources is None else sources
        self.marks = self.versions()
        groups = list(self.groups.values())
        if self.has_staging and _zero_on_host(weight):
            # Cross-device copies are not free: skip them on the steps update_every leaves out.
            # (Same-device updates never read the weight in Python.)
            groups = []
        self._stage(groups, values)
        _write_all([*groups, *self.copies.values()], values, weight, step)

    def start(self, walk: list, weight, step, runner) -> bool:
        """A non_blocking update: device EMAs update in stream order now; the copies for a CPU
        EMA are issued on side streams and a worker thread averages once they have landed.
        Returns whether work was left to the worker. That job is prepared before anything is
        written, so a caller interrupted anywhere can settle it (AsyncRunner.settle)."""
        # Its copies come before the op that checks storage, and torch's read freed memory
        # (ModelEma's error then names the tensor).
        refuse_freed(zip(range(len(walk)), walk), "the model's tensor")
        self.marks = self.versions()
        skipped = _zero_on_host(weight)
        copies = self.copies.values()
        now = [g for g in self.groups.values() if g.device.type != "cpu"]
        # A CPU EMA's sources are all staged (snapshot plan): its writes wait for them to land.
        later = [g for g in self.groups.values() if g.device.type == "cpu" and not skipped]
        later += [c for c in copies if c.staging]
        self._stage(now, walk)
        pairs = [pair for g in later for pair in g.staged_copies(walk)]
        if pairs:
            events = runner.issue_copies(pairs)

            def finish():
                for event in events:
                    event.synchronize()
                _write_all(later, walk, weight, step, landed=True)

            runner.prepare(finish, self.started)
        _write_all([*now, *(c for c in copies if not c.staging)], walk, weight, step)
        if pairs:
            runner.launch()
        return bool(pairs)

    @staticmethod
    def _stage(groups: list, values: list) -> None:
        """Copies the staged sources of `groups` into place; nothing of the EMA is written yet."""
        copy_pairs([pair for g in groups for pair in g.staged_copies(values)], non_blocking=True)
        for cuda_device in {d for g in groups for d in g.wait_for}:
            # copies into pinned host memory must land before the CPU kernel reads them
            torch.cuda.current_stream(cuda_device).synchronize()


def copy_pairs(pairs, non_blocking: bool = False) -> None:
    """view <- src for every (view, src), by one call."""
    if pairs:
        views, srcs = zip(*pairs)
        torch._foreach_copy_(list(views), list(srcs), non_blocking=non_blocking)


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


def _write_all(groups: list, *args, landed: bool = False) -> None:
    """Runs each group's write (DeviceGroup.write, CopyGroup.write) with `args`. If one raises
    after an earlier one wrote (an interrupt arriving once a kernel has returned), the writes
    that have not happened still run and the error propagates after: the EMA never holds half an
    update. A write has happened when the version counter of its group's first EMA tensor has
    moved."""
    marks = [g.ema[0]._version for g in groups]
    try:
        for group in groups:
            group.write(*args, landed)
    except BaseException:
        moved = [g.ema[0]._version != mark for g, mark in zip(groups, marks)]
        if not any(moved):
            raise
        for group, happened in zip(groups, moved):
            if not happened:
                group.write(*args, landed)
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
