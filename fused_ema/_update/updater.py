"""ModelEma's update as one transaction (the plan for the model's walk, following the model when
it changed, run here or started on the worker for non_blocking, then the step committed, or all of
it undone), and the order of every other use: it waits for an update in flight and stays out
while swapped() lends the EMA's tensors to the model. Owns the state no copy or pickle carries."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from .._dist.dtensor import reshard_fsdp
from .._ext.grad import without_grad
from .._ext.loader import _C
from .._model.swap import Swap, check_writable, finish_all
from .._model.tracking import average_dtype
from .._model.walk import tensor_walk, walk_agrees
from ..ops import freed_tensors, storage_shortfall
from . import prepared as prep
from .binding import shared_with_ema
from .nonblocking import AsyncRunner
from .schedule import whole_number


def _int64(step) -> bool:
    """Whether the op's schema takes `step` as the int it is (the op checks its range), without
    a guard on its value where dynamo made it dynamic."""
    return type(step) is int and -(2**63) <= step < 2**63


def _refused_tensors(tracks, model) -> str:
    """After the ops refused an update: the model's tensors whose storage no longer holds their
    elements or is one of the EMAs' tensors', and the EMA tensors converted behind the EMA's back
    (ema.module.double()), as the error names them (the ops can only give list indices); empty
    when none is."""

    converted = []
    for track in tracks:
        dtype = track.binding.policy.dtype
        for e in track.binding.table.entries:
            source = e.bound()
            if e.average and source is not None and e.ema.dtype != average_dtype(source, dtype):
                converted.append(f"{e.name} ({e.ema.dtype}, the model's {source.dtype})")
    named = [*model.named_parameters(), *model.named_buffers()]
    found = [f"the model's {what}" for what in freed_tensors(named)]
    entries = [e for track in tracks for e in track.binding.table.entries]
    found += shared_with_ema(entries, [(n, t) for n, t in named if storage_shortfall(t) is None])
    if converted and not found:  # (a model whose dtype changed is staged: not the cause then)
        found.append(
            f"EMA tensors hold a dtype the EMA does not average them in: {', '.join(converted)} "
            "(converted through ema.module? ema.to(dtype) converts the whole EMA)"
        )
    return ", ".join(found)


class _Declined(Exception):
    """A prepared update found a tensor no longer what it was planned for, and changed nothing."""


def _dispatch_modes() -> bool:
    """Whether a torch function or dispatch mode is active: it must see the fused ops, which a
    prepared update runs without the dispatcher."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()


class Updater:
    def __init__(self, binding, schedule):
        self.binding = binding
        self.schedule = schedule
        self.runner = AsyncRunner()
        self.swapped = False
        # Several EMAs of one model updated in one pass (fused_ema.PostHocEma): the leader's
        # update also updates its followers' EMAs, from one read of the model (ops.lerp_many_);
        # a follower waits for its leader's work in flight and cannot update on its own.
        self.followers: tuple = ()
        self.joint = "lerp_many"  # how a leader updates its followers (plan.DeviceGroup.joined)
        self.leader = None
        # The class of the PostHocEma or Bema whose track this EMA is (any track, the leader too),
        # set by the set: its own update(), attach() and schedule setters raise (ema.py).
        self.owner: str | None = None
        self.ema_ref = None  # a follower's ModelEma (weakly: it owns this updater)
        self.lock = threading.RLock()  # one update at a time (see update)
        self.prepared = None  # the plan of the latest blocking update, prepared (prepared.py)

    def follow(self, leader, ema, joint: str = "lerp_many") -> None:
        """Makes `ema` (this updater's ModelEma) one of the EMAs `leader` updates, the way
        `joint` says: "lerp_many" (each its own lerp) or "bema" (Bema's EMA, theta0 and
        corrected weights, in that order)."""
        self.leader, self.ema_ref = leader, weakref.ref(ema)
        if self not in leader.followers:  # a TrackSet unpickled, or copied, follows again
            leader.followers = (*leader.followers, self)
        leader.joint = joint

    def ready(self, what: str = "", error: str = "") -> None:
        """Before any use of the EMA (ema.`what`()): a non_blocking update finished, and not
        inside swapped(), where it raises `error` if given."""
        if self.leader is not None:
            self.leader.synchronize()
        self.synchronize()
        if self.swapped:
            raise RuntimeError(
                error
                or f"ema.{what}() inside `with ema.swapped(model)`: the EMA tensors hold the "
                "model's weights until the block ends"
            )

    def update(self, ema, model, step, non_blocking: bool, values=None) -> None:
        """One update of `ema` toward `model` (unwrapped); `values` are those a compiled program
        walked. A failure leaves the step, the schedule and the binding as they were. Another
        thread's update meanwhile is refused: the two would average into the same tensors."""
        lock = self._acquire("ModelEma.update()")
        try:
            for track in (self, *self.followers):  # a follower's tensors are written too
                track.ready("update")
            if self.leader is not None:
                raise RuntimeError(
                    f"fused_ema: this EMA is one of a {self.owner}'s tracks, which update "
                    f"together: call the {self.owner}'s update()"
                )
            step = self.schedule.check_step(step)
            # A step begun by an update that landed whole but was interrupted before it could
            # commit: it is final, and this update must not roll it back if it fails.
            self._end(commit=True)
            blocking = not non_blocking and values is None
            if blocking and self._run_prepared(model, step):
                return
            walk, names = self.binding.walk(model, non_blocking)
            args = (ema, model, walk, names, step, non_blocking, values)
            # trusted: the present plans' prepared update runs, and checks every tensor itself
            trusted = blocking and self._current() is not None
            try:
                try:
                    done = without_grad(self._update, *args, trusted)
                except _Declined:  # checked in Python now: a tensor changed, or only where it lives
                    done = without_grad(self._update, *args, False)
            except (ValueError, RuntimeError) as error:  # the ops name tensors by list index
                if type(error) not in (ValueError, RuntimeError):
                    raise  # StructureMismatchError, CheckpointError: named already
                named = _refused_tensors((self, *self.followers), model)
                if named:
                    message = f"fused_ema: {named}; nothing was changed"
                    raise ValueError(message) from error
                raise
            if done:
                self._end(commit=True)
        finally:
            lock.release()

    def _acquire(self, what: str):
        """The lock of this EMA (its set's, for a track) for one call that reads and writes its
        tensors; another thread's such call meanwhile is refused: the two would tear them."""
        lock = (self.leader or self).lock
        if not lock.acquire(blocking=False):
            raise RuntimeError(
                f"fused_ema: {what}: an update, load or swapped() of this EMA is already running "
                "in another thread; two at once would tear the EMA tensors and their step. Use "
                "the EMA from one thread (or hold a lock around the calls)"
            )
        return lock

    @contextlib.contextmanager
    def exclusive(self, what: str):
        """_acquire() for the block."""
        lock = self._acquire(what)
        try:
            yield
        finally:
            lock.release()

    def _schedules(self) -> list:
        return [self.schedule] + [f.schedule for f in self.followers]

    def _plans(self) -> tuple:
        return (self.binding.plan, *(f.binding.plan for f in self.followers))

    def _current(self):
        """The prepared update, where it is prepared for the present plans and schedules and no
        mode must see the fused ops; else None."""
        prepared = self.prepared
        if prepared is None or _dispatch_modes():
            return None
        return prepared if prepared.current(self._plans(), self._schedules()) else None

    def _run_prepared(self, model, step) -> bool:
        """The steady state: one call runs the update prepared for the current plan, when the
        walk cache (3.12+) vouches that `model` is unchanged. False when it cannot: then nothing
        has changed and the full update runs."""
        plan = self.binding.plan
        cache = None if plan is None else plan._walk_cache
        prepared = None if cache is None or isinstance(step, torch.Tensor) else self._current()
        if prepared is None:
            return False
        for schedule in self._schedules():
            schedule.note_capture()
        return prepared.run(cache, model, *prep.step_mode(step), False)

    def _update(self, ema, model, walk, names, step, non_blocking: bool, values, trusted) -> bool:
        """update() with autograd off; False when the worker finishes it (synchronize() then
        commits or rolls back). `trusted`: the plans are prepared, and the prepared update checks
        the tensors (raising _Declined, having changed nothing, where one changed)."""
        schedules = self._schedules()
        plan, undos, wrote = None, [], lambda: False
        try:
            plans = []
            for track, track_ema in ((self, ema), *((f, f.ema_ref()) for f in self.followers)):
                plans.append(
                    track.binding.plan_for(
                        track_ema, model, walk, names, non_blocking, track.schedule, trusted, undos
                    )
                )
            plan = plans[0].joined(plans[1:], self.joint) if self.followers else plans[0]
            if plan.meta:
                raise RuntimeError(
                    f"fused_ema: {len(plan.meta)} EMA tensors were made from a meta-device model "
                    f"and hold no values (e.g. {plan.meta[0]}); call ema.resync(model) once the "
                    "model is materialised (model.to_empty(...) and its initialisation)"
                )
            if values is not None and not walk_agrees(values, walk):
                # The traced walk (_model/walk.py, the Python form dynamo can follow) must be the
                # C walk item for item: a disagreement is refused, never averaged.
                raise RuntimeError("fused_ema: the compiled program walked another model structure")
            plan.marks = None  # nothing of this update written yet (plan.started())
            prepared = None
            if not non_blocking and values is None:  # blocking: prepared where it can be
                prepared = self._current()
                if prepared is None and not _dispatch_modes():
                    if self.prepared is not None:
                        self.prepared.free()
                        self.prepared = None
                    if prep.preparable(plan, schedules, walk):
                        self.prepared = prep.Prepared(plan, self._plans(), schedules, model, walk)
                    prepared = self.prepared
            mode, value = prep.step_mode(step)
            for schedule in schedules:
                # A prepared run moves the counters itself, unless the step is a tensor.
                if prepared is None or mode == prep.KEEP:
                    schedule.begin(step)
                schedule.note_capture()
            if prepared is not None:
                # One call, all or nothing: its count of runs tells which, whatever interrupts it.
                runs = prepared.runs()
                wrote = lambda: prepared.runs() != runs  # noqa: E731
                if not prepared.run(None, None, mode, value, not trusted):
                    raise _Declined
                return True
            weight = schedules[0].weight
            if self.followers:  # a joined plan: one weight per EMA (the leader's first)
                # A generator, not a list comprehension: Python 3.12 inlines those, and an
                # interrupt raised at a line inside one can skip this try's handler.
                weight = torch.cat(tuple(s.weight for s in schedules))
            if not non_blocking:
                plan.run(walk, weight, self.schedule.step, values)
            elif plan.start(walk, weight, self.schedule.step, self.runner):
                return False
        except BaseException:
            # Made here, not before the try: a successful update makes no closure.
            def settle():
                if self.runner.busy:
                    self.runner.settle()  # a job this call prepared: finished or dropped

            def roll_back():  # idempotent, as finish_all needs
                written = wrote() or (plan is not None and plan.started())
                self._end(commit=written)  # it wrote, so it finished: only the error propagates
                if not written:
                    for undo in reversed(undos):
                        undo()  # a resync that the failed update made is undone too

            finish_all([settle, roll_back])  # both to their end, whatever interrupts them
            raise
        return True

    def _end(self, commit: bool) -> None:
        """Makes the step every schedule began final, or undoes it."""
        for schedule in self._schedules():
            if commit:
                schedule.commit()
            else:
                schedule.rollback()

    def trace(self, model, step, key: int) -> None:
        """update() inside torch.compile: the traced program walks the model and calls the op
        (see compiled.py) whose body, update_traced(), runs the same update on the live model."""
        walk = tensor_walk(model, self.binding.with_buffers)
        steps = (step, None) if isinstance(step, torch.Tensor) else (None, step)
        refusal = None
        if not (step is None or isinstance(step, torch.Tensor) or _int64(step)):
            # Checked while tracing, refused when the program runs: the schema would take True as
            # 1 and fail on a float with a tracing error, where eager update raises ValueError.
            try:
                whole_number("step", step, 0)
            except ValueError as error:
                steps, refusal = (None, None), str(error)
        torch.ops.fused_ema.model_ema_update(self.schedule.step, walk, *steps, key, refusal)

    def update_traced(self, ema, values: list, step) -> None:
        model = self.binding.model_ref()
        if model is None:
            raise RuntimeError("fused_ema: the model this EMA follows no longer exists")
        plan = self.binding.plan
        if plan is not None and not plan.snapshot and _C.walk_matches(values, plan.refs):
            # The program handed over the model's own tensors (none of them computed anew in
            # the graph): the eager update, prepared, averages the very same values.
            values = None
        self.update(ema, model, step, False, values)

    def synchronize(self) -> None:
        """Waits for a non_blocking update still running, raising the error it ended with (the
        step then reads as before that update, which wrote nothing)."""
        if not self.runner.busy:
            return
        started = self.runner.started
        try:
            self.runner.wait()
        except BaseException:
            if self.runner.busy:
                raise  # interrupted while waiting: the job still runs
            self._end(commit=started())
            raise
        self._end(commit=True)

    @contextlib.contextmanager
    def lend(self, model):
        """ModelEma.swapped(): the EMA weights in `model`'s own tensors for the block."""
        with self.exclusive("ema.swapped()"):  # the whole block: no update of another thread
            yield from self._lend(model)

    def _lend(self, model):
        pairs = self.binding.pairs_with(model)
        check_writable(pairs)
        swap = Swap(pairs)  # prepared: nothing written yet

        def swap_out():  # idempotent: swap_out may run again
            try:
                swap.swap_out()
            except ValueError:
                if swap.changed:  # a tensor the block changed: the others are back
                    self.swapped = False
                raise
            self.swapped = False
            reshard_fsdp(model)  # FSDP2 keeps parameters it gathered inside the block

        try:
            swap.swap_in()  # one call, or a collective then one call (ModelEma(shard=...))
            self.swapped = True
            yield model
        finally:
            # To its end whatever interrupts it; an interrupt propagates once the model and the
            # EMA hold their own values again.
            finish_all([swap_out])
