"""An update plan prepared in the extension (csrc/prepared_update.h): tensors handed over once, then
one call per update that checks them, moves the schedules and runs every lerp and copy, refusing
before the first write. current() checks in Python the views the extension cannot (DTensor shards,
replica rows, ZeRO-3 partitions); staged, non_blocking and compiled updates run UpdatePlan's way."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .._dist.dtensor import is_dtensor
from .._dist.zero3 import base, copied, is_zero3
from .._ext.loader import _C
from ..ops import _as_int64
from .plan import LERP_MANY_STOCHASTIC, LERP_STOCHASTIC, UpdatePlan

# How a run moves the step counters (csrc/prepared_update.h's StepMode).
ADVANCE, SET, KEEP = 0, 1, 2


def step_mode(step) -> tuple[int, int]:
    """How a run moves the counters for update(step=`step`): None advances them, an int sets
    them, a tensor is read in Python (Schedule.begin) and the run keeps them."""
    if isinstance(step, torch.Tensor):
        return KEEP, 0
    return (ADVANCE, 0) if step is None else (SET, step)


# Tensors the extension may hold and run without Python: no subclass dispatches through Python.
_PLAIN = (torch.Tensor, nn.Parameter)


class Prepared:
    """`plan` with `schedules` (one per EMA, the plan's order), prepared. `plan` joins `plans`,
    the plan of each EMA, when there are several (PostHocEma, Bema)."""

    def __init__(self, plan: UpdatePlan, plans: tuple, schedules: list, model, walk: list):
        self.plans = plans
        self.steps = tuple(s.step for s in schedules)  # Schedule.place() replaces them
        _, shards, cuts = _sources(plan, walk)
        # (DTensor, its local shard), both weakly: what the extension averages for a DTensor.
        self.shards = tuple(
            (weakref.ref(walk[i]), weakref.ref(walk[i]._local_tensor)) for i in shards
        )
        # (a tensor whose rows are averaged, weakly, and its memory when prepared).
        self.cuts = tuple((weakref.ref(walk[i]), _memory(walk[i])) for i in cuts)
        tensors = [t for s in schedules for t in (s.step, s.out, s.config)]
        self.handle = torch.ops.fused_ema.prepared_new(tensors)
        self._free = weakref.finalize(self, _C.prepared_free, self.handle)
        # The extension holds the model's tensors: they go with the model, as an unprepared
        # plan's weak references would.
        self._with_model = weakref.finalize(model, self._free)
        for group in plan.groups.values():
            self._add_group(group, schedules, walk)
        for copies in plan.copies.values():
            torch.ops.fused_ema.prepared_add_copies(
                self.handle, copies.ema, [copied(walk[i]) for i in copies.index], False
            )

    def _add_group(self, group, schedules: list, walk: list) -> None:
        if group.staged:  # copied into place by the run, before its calls
            views, parts = zip(*group.staged_copies(walk))
            torch.ops.fused_ema.prepared_add_copies(self.handle, views, parts, True)
        tracks, kind, many = (group, *group.followers), group.kind, bool(group.followers)
        weights = schedules[0].weight
        if many:  # a weight per track, which each run copies from its schedule (`joint`)
            weights = torch.zeros(len(tracks), dtype=torch.float64, device=weights.device)
        stochastic = kind in (LERP_STOCHASTIC, LERP_MANY_STOCHASTIC)
        torch.ops.fused_ema.prepared_add_call(
            self.handle,
            kind,
            [e for g in tracks for e in g.ema],
            group.sources(walk),
            weights,
            list(range(len(tracks))) if many else [],
            schedules[0].step if stochastic else None,
            [_as_int64(g.seed, "seed") for g in tracks] if stochastic else [],  # same bits
            [k for g in tracks for k in g.keys] if stochastic else [],
            group.offsets if stochastic else [],
        )

    def current(self, plans: tuple, schedules: list) -> bool:
        """Whether this was prepared for the EMAs' present plans and schedule tensors, its model
        is alive, each DTensor source still holds the local shard prepared and each tensor whose
        rows are averaged (or its ZeRO-3 partition) the same memory."""
        return (
            self._free.alive
            and plans == self.plans  # by identity; one schedule per plan, as when prepared
            and all(a is s.step for a, s in zip(self.steps, schedules))
            and (
                not self.shards  # each DTensor alive (0 where gone) and holding the shard prepared
                or all(h() is getattr(d(), "_local_tensor", 0) for d, h in self.shards)
            )
            and (not self.cuts or all(_memory(t()) == memory for t, memory in self.cuts))
        )

    def run(self, cache, model, mode: int, step: int, replan: bool) -> bool:
        return _C.run_prepared(self.handle, cache, model, mode, step, replan)

    def free(self) -> None:
        """Drops the extension's update and the tensors it holds."""
        self._with_model.detach()
        self._free()

    def runs(self) -> int:
        """How many runs have completed (each wrote everything)."""
        return _C.prepared_runs(self.handle)


def preparable(plan: UpdatePlan, schedules: list, walk: list) -> bool:
    """Whether `plan` can be prepared: every source a plain CPU/CUDA tensor of the walk (or its
    local shard), and the weights and step where each group's kernel reads them."""
    if plan.snapshot:
        return False
    place = schedules[0].step.device
    for group in plan.groups.values():
        if place.type != "cpu" and place != group.device:
            return False
        if any(type(e) not in _PLAIN for g in (group, *group.followers) for e in g.ema):
            return False
    plain, shards, cuts = _sources(plan, walk)
    sources = [walk[i] for i in plain + cuts] + [walk[i]._local_tensor for i in shards]
    sources += [walk[i] for copies in plan.copies.values() for i in copies.index]
    emas = [e for copies in plan.copies.values() for e in copies.ema]
    return all(type(t) in _PLAIN for t in (*sources, *emas))


def _sources(plan: UpdatePlan, walk: list) -> tuple[list, list, list]:
    """The walk indices of the sources that are whole tensors, DTensor shards, and rows of a
    replica or a ZeRO-3 partition (copied partitions too), staged ones included."""
    plain, shards, cuts = [], [], []
    for group in plan.groups.values():
        plain += group.direct
        shards += group.shards
        cuts += [i for i, *_ in group.cuts]
        for i, cut in group.staged:
            (cuts if cut is not None else shards if is_dtensor(walk[i]) else plain).append(i)
    cuts += [i for c in plan.copies.values() for i in c.index if is_zero3(walk[i])]
    return plain, shards, cuts


def _memory(t):
    """Where a tensor's elements lie (None once it is gone): a view of its rows stays valid while
    this does not change. For a ZeRO-3 parameter, those of its partition (the cut's base)."""
    if t is None:
        return None
    t = base(t)
    return (t.data_ptr(), t.dtype, t.shape, t.stride())
