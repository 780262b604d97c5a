"""ModelEma's update as one transaction (the plan for the model's walk, following the model when
it changed, run here or started on the worker for non_blocking, then the step committed, or all of
it undone), and the order of every other use: it waits for an update in flight and stays out
while swapped() lends the EMA's tensors to the model. Owns the state no copy or pickle carries."""

from __future__ import annotations

import contextlib

import torch

from .._dist.dtensor import reshard_fsdp
from .._ext.grad import without_grad
from .._ext.loader import _C
from .._model.swap import Swap, check_writable
from .._model.walk import tensor_walk
from .nonblocking import AsyncRunner

walk_agrees = _C.walk_agrees


class Updater:
    def __init__(self, binding, schedule):
        self.binding = binding
        self.schedule = schedule
        self.runner = AsyncRunner()
        self.pending_plan = None  # the plan a non_blocking update runs on the worker
        self.swapped = False

    def ready(self, what: str) -> None:
        """Before any use of the EMA: a non_blocking update finished, and not inside swapped()."""
        if self.runner.busy:
            self.synchronize()
        if self.swapped:
            raise RuntimeError(
                f"ema.{what}() inside `with ema.swapped(model)`: the EMA tensors "
                "hold the model's weights until the block ends"
            )

    def check(self, error: str) -> None:
        """ready() with its own message for the RuntimeError raised inside swapped()."""
        self.synchronize()
        if self.swapped:
            raise RuntimeError(error)

    def update(self, ema, model, step, non_blocking: bool, values=None) -> None:
        """One update of `ema` toward `model` (unwrapped); `values` are those a compiled program
        walked. A failure leaves the step, the schedule and the binding as they were."""
        step = self.schedule.check_step(step)
        walk, names = self.binding.walk(model, non_blocking)
        if without_grad(self._update, ema, model, walk, names, step, non_blocking, values):
            self.schedule.commit()

    def _update(self, ema, model, walk, names, step, non_blocking: bool, values) -> bool:
        """update() with autograd off; False when the worker finishes it (synchronize() then
        commits or rolls back)."""
        schedule = self.schedule
        plan, undo = None, None
        try:
            plan, undo = self.binding.plan_for(ema, model, walk, names, non_blocking, schedule)
            if values is not None and not walk_agrees(values, walk):
                # The traced walk (_model/walk.py, the Python form dynamo can follow) must be the
                # C walk item for item: a disagreement is refused, never averaged.
                raise RuntimeError("fused_ema: the compiled program walked another model structure")
            plan.forget_run()
            schedule.begin(step)
            schedule.note_capture()
            if non_blocking:
                if plan.start(walk, schedule, self.runner):
                    self.pending_plan = plan
                    return False
            else:
                plan.run(walk, schedule, values)
        except BaseException:
            if plan is not None and plan.started():
                schedule.commit()  # it wrote, so it finished: only the error propagates
            else:
                schedule.rollback()
                if undo is not None:
                    undo()  # a resync that the failed update made is undone too
            raise
        return True

    def trace(self, model, step, key: int) -> None:
        """update() inside torch.compile: the traced program walks the model and calls the op
        (see compiled.py) whose body, update_traced(), runs the same update on the live model."""
        walk = tensor_walk(model, self.binding.with_buffers)
        tensor_step = step if isinstance(step, torch.Tensor) else None
        int_step = None if isinstance(step, torch.Tensor) else step
        torch.ops.fused_ema.model_ema_update(self.schedule.step, walk, tensor_step, int_step, key)

    def update_traced(self, ema, values: list, step) -> None:
        model = self.binding.model_ref()
        if model is None:
            raise RuntimeError("fused_ema: the model this EMA follows no longer exists")
        self.ready("update")
        self.update(ema, model, step, False, values)

    def synchronize(self) -> None:
        """Waits for a non_blocking update still running, raising the error it ended with (the
        step then reads as before that update, which wrote nothing)."""
        if not self.runner.busy:
            return
        try:
            self.runner.wait()
        except BaseException:
            if self.runner.busy:
                raise  # interrupted while waiting: the job still runs
            plan, self.pending_plan = self.pending_plan, None
            if plan is not None and not plan.started():
                self.schedule.rollback()
            else:
                self.schedule.commit()
            raise
        self.pending_plan = None
        self.schedule.commit()

    @contextlib.contextmanager
    def lend(self, model):
        """ModelEma.swapped(): the EMA weights in `model`'s own tensors for the block."""
        pairs = self.binding.pairs_with(model)
        check_writable(pairs)
        swap = Swap(pairs)
        swap.swap_in()
        self.swapped = True
        try:
            yield model
        finally:
            # Finished even if an interrupt lands in it: swap_out resumes where it stopped, and
            # the interrupt propagates once the model and the EMA hold their own values again.
            interrupt = None
            while True:
                try:
                    swap.swap_out()
                    self.swapped = False
                    # FSDP2 keeps parameters it gathered inside the block: they hold the EMA's
                    # weights.
                    reshard_fsdp(model)
                    break
                except BaseException as err:
                    if isinstance(err, Exception):
                        raise  # a failure, not an interrupt: retrying would not help
                    interrupt = err
            if interrupt is not None:
                raise interrupt
