"""ModelEma: a device-safe, fused exponential moving average of a model's weights.

The public façade. The parts that own state live beside it: the schedule (_schedule.py), the
entries and how a model is matched to them (_tracking.py), the update plan that every mode runs
(_plan.py, with _async.py for non_blocking and _compiled.py for torch.compile), the evaluation
views (_module_view.py, _swap.py) and checkpoints (checkpoint.py). Any public call that raises
leaves the EMA (tensors, step, schedule) and the model as they were.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Union

import torch
from torch import nn

from . import _compiled
from ._async import AsyncRunner
from ._binding import Binding
from ._dtensor import gather_full, reshard_fsdp
from ._plan import UpdatePlan
from ._schedule import (
    Schedule,
    check_options,
    check_rounding,
    options_from_state,
    rounding_from_state,
)
from ._stats import ema_stats
from ._swap import Swap, check_writable, copy_all
from ._tracking import (
    EntryPolicy,
    tensor_walk,
    unwrap_model,
)
from .checkpoint import FORMAT, FORMAT_VERSION, LoadResult, prepare_load, read_file
from .errors import CheckpointError, PrecisionWarning

__all__ = ["LoadResult", "ModelEma"]

BUFFER_MODES = ("average", "copy", "ignore")
MISMATCH_MODES = ("error", "resync")
_LOW_PRECISION = (torch.bfloat16, torch.float16)

Device = Union[str, torch.device, None]


class ModelEma:
    """Exponential moving average of a model's parameters and buffers.

    Args:
        model: the module to follow (DDP / DataParallel / torch.compile wrappers are unwrapped).
        decay: per-step decay; the update is ``ema += (1 - decay) * (model - ema)``.
        device: None keeps each EMA tensor with its model tensor (following it if it moves);
            "cpu", "cuda:1", ... keeps the whole EMA there and copies model tensors across.
        dtype: EMA dtype for floating tensors; None means float32 for 16/32-bit weights and
            float64 for float64 ones.
        buffers: "average" float buffers and copy the others (num_batches_tracked stays exact),
            "copy" every buffer, or "ignore" buffers.
        warmup: False, True (gamma=1, power=2/3) or (gamma, power): the decay of averaging step
            s is ``min(decay, max(min_decay, 1 - (1 + s / gamma) ** -power))``.
        min_decay: lower bound of the warmup decay.
        update_after_step: steps up to ``update_after_step + 1`` copy the model.
        update_every: update on steps 1, 1 + k, 1 + 2k, ... with ``decay ** k``.
        on_mismatch: "error" raises when the model's tensors were added, removed, renamed,
            reshaped or replaced; "resync" follows them (kept tensors keep their average).
        stochastic_rounding, stochastic_rounding_seed: bfloat16/float16 EMA tensors (dtype=)
            are rounded stochastically, so that updates below their resolution still move them
            in expectation (timm 1.0.31's keywords and default). The random bits depend on the
            seed, the step, the tensor's name and each element's index in the full tensor only:
            every DDP rank, every FSDP2 shard layout and a resumed run give the same bits.
        use_warmup, warmup_gamma, warmup_power, exclude_buffers, foreach: timm ModelEmaV3's
            spellings, accepted so that it can be swapped in unchanged.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        *,
        device: Device = None,
        dtype: torch.dtype | None = None,
        buffers: str = "average",
        warmup=False,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        update_every: int = 1,
        on_mismatch: str = "error",
        stochastic_rounding: bool = True,
        stochastic_rounding_seed: int = 0,
        use_warmup: bool | None = None,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2.0 / 3.0,
        exclude_buffers: bool | None = None,
        foreach: bool | None = None,  # noqa: ARG002  (timm's option; always fused here)
    ):
        if use_warmup is not None:
            warmup = (warmup_gamma, warmup_power) if use_warmup else False
        if exclude_buffers:
            buffers = "copy"
        if buffers not in BUFFER_MODES:
            raise ValueError(f"buffers must be one of {BUFFER_MODES}, got {buffers!r}")
        if on_mismatch not in MISMATCH_MODES:
            raise ValueError(f"on_mismatch must be one of {MISMATCH_MODES}, got {on_mismatch!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
        options = check_options(decay, min_decay, warmup, update_after_step, update_every)
        self._rounding = check_rounding(stochastic_rounding, stochastic_rounding_seed)
        policy = EntryPolicy(torch.device(device) if device is not None else None, dtype, buffers)
        self._init_transient()
        self._binding = Binding(self, unwrap_model(model), policy, on_mismatch, self._seed())
        self._schedule = Schedule(options, self._binding.schedule_device())
        self._warn_precision()

    def _init_transient(self) -> None:
        """The state no copy or pickle carries: rebuilt from the rest when needed."""
        self._runner = AsyncRunner()
        self._pending_plan: UpdatePlan | None = None
        self._swapped = False
        self._key = _compiled.register(self)

    # ------------------------------------------------------------------ schedule and state

    @property
    def decay(self) -> float:
        """The configured per-step decay (the warmup ramps up to it)."""
        return self._schedule.options["decay"]

    @property
    def step(self) -> int:
        """Updates counted so far (or the last step passed to update). Reads a device tensor."""
        self.synchronize()
        return self._schedule.value()

    @property
    def current_decay(self) -> float:
        """The per-step decay of the latest step (0.0 while copying). Reads a device tensor."""
        self.synchronize()
        return self._schedule.current_decay()

    @property
    def schedule(self) -> dict:
        return dict(self._schedule.options)

    @property
    def device(self) -> torch.device | None:
        return self._binding.policy.device

    @property
    def _plan(self) -> UpdatePlan | None:
        return self._binding.plan

    @property
    def buffers(self) -> str:
        return self._binding.policy.buffers

    @property
    def on_mismatch(self) -> str:
        return self._binding.on_mismatch

    def _seed(self):
        rounding = self._rounding
        return rounding["stochastic_rounding_seed"] if rounding["stochastic_rounding"] else None

    def names(self) -> list[str]:
        """Every tracked name, tied weights under each of their names."""
        return self._binding.table.names()

    # ------------------------------------------------------------------ updating

    def update(
        self, model: nn.Module, step: int | torch.Tensor | None = None, non_blocking: bool = False
    ) -> None:
        """One EMA step toward `model`'s current weights.

        `step` (an int or an integer tensor, e.g. the optimizer's step count from 1) drives
        warmup, update_after_step and update_every; without it the EMA counts its own updates.
        With model and EMA on one device this issues no host sync.

        `non_blocking=True` (for an EMA kept on the CPU) returns at once: the model's tensors are
        copied into pinned staging buffers on a side stream that the training stream waits for
        (so the next optimizer step cannot overwrite them first), and the CPU update runs on a
        worker thread. ema.synchronize() waits for it; so does every read of the EMA. If the
        worker fails, the next call raises its error and the step is as before that update.
        """
        if torch.compiler.is_compiling():
            walk = tensor_walk(unwrap_model(model), self._binding.with_buffers)
            tensor_step = step if isinstance(step, torch.Tensor) else None
            int_step = None if isinstance(step, torch.Tensor) else step
            step_state = self._schedule.step
            torch.ops.fused_ema.model_ema_update(step_state, walk, tensor_step, int_step, self._key)
            return
        self._ready("update")
        self._update(unwrap_model(model), step, non_blocking)

    def _update_from_trace(self, values: list, step) -> None:
        """The body of the op a compiled update calls: the same update, on the live model."""
        model = self._binding.model_ref()
        if model is None:
            raise RuntimeError("fused_ema: the model this EMA follows no longer exists")
        self._ready("update")
        self._update(model, step, False, values)

    def _update(self, model: nn.Module, step, non_blocking: bool, values=None) -> None:
        step = self._schedule.check_step(step)
        walk, names = self._binding.walk(model, non_blocking)
        plan, undo = None, None
        schedule = self._schedule
        with torch.no_grad():
            try:
                plan, undo = self._binding.plan_for(
                    self, model, walk, names, non_blocking, schedule
                )
                if values is not None and len(values) != len(walk):
                    raise RuntimeError(
                        "fused_ema: the compiled program walked another model structure"
                    )
                plan.forget_run()
                schedule.begin(step)
                schedule.note_capture()
                if non_blocking:
                    if plan.start(walk, schedule, self._runner):
                        self._pending_plan = plan
                        return  # synchronize() commits or rolls back
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
        schedule.commit()

    def synchronize(self) -> None:
        """Waits for a non_blocking update still running, raising the error it ended with (the
        step then reads as before that update, which wrote nothing)."""
        if not self._runner.busy:
            return
        try:
            self._runner.wait()
        except BaseException:
            if self._runner.busy:
                raise  # interrupted while waiting: the job still runs
            plan, self._pending_plan = self._pending_plan, None
            if plan is not None and not plan.started():
                self._schedule.rollback()
            else:
                self._schedule.commit()
            raise
        self._pending_plan = None
        self._schedule.commit()

    def resync(self, model: nn.Module) -> None:
        """Follows the model's current tensors: each keeps its average under its current names
        (matched by identity, then by name and shape), new or reshaped ones start from the model,
        removed ones go."""
        self._ready("resync")
        self._binding.resync(self, unwrap_model(model), self._schedule)
        self._warn_precision()

    def _ready(self, what: str) -> None:
        """Before any use of the EMA: a non_blocking update finished, and not inside swapped()."""
        self.synchronize()
        if self._swapped:
            raise RuntimeError(
                f"ema.{what}() inside `with ema.swapped(model)`: the EMA tensors "
                "hold the model's weights until the block ends"
            )

    # ------------------------------------------------------------------ using the average

    @property
    def module(self) -> nn.Module:
        """An nn.Module in eval mode evaluating the EMA weights: the model's structure (copied
        without its tensors) with the EMA tensors as its weights, shared, not stored twice. For a
        model deepcopy refuses (FSDP2, locks, handles) it runs the model itself with the EMA
        swapped in for each call (see swapped())."""
        self.synchronize()
        return self._binding.module_for(self)

    def _before_module_forward(self) -> None:
        self.synchronize()
        if self._swapped:
            raise RuntimeError(
                "ema.module(...) inside `with ema.swapped(model)`: the EMA tensors hold the "
                "model's weights until the block ends; inside it, call the model itself"
            )

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        """Puts the EMA weights into `model`'s own tensors for the block and restores them after,
        also when the block raises. The tensors stay the same objects at the same addresses, so
        optimizers, hooks and compiled graphs see the EMA weights. Tensors of the EMA's dtype and
        device are exchanged in place through a scratch buffer of at most 16 MiB per dtype and
        device; others (a 16-bit model with a float32 EMA) have their values saved aside, which
        costs their size."""
        self._ready("swapped")
        model = unwrap_model(model)
        pairs = self._binding.pairs_with(model)
        check_writable(pairs)
        swap = Swap(pairs)
        swap.swap_in()
        self._swapped = True
        try:
            yield model
        finally:
            swap.swap_out()
            # FSDP2 keeps parameters it gathered inside the block: they hold the EMA's weights.
            reshard_fsdp(model)
            self._swapped = False

    def copy_to(self, model: nn.Module) -> None:
        """Writes the EMA weights into `model` (matched by name, cast to its dtypes/devices)."""
        self._ready("copy_to")
        pairs = self._binding.pairs_with(unwrap_model(model))
        check_writable(pairs)
        copy_all(pairs)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Names -> EMA tensors (tied weights under each name), the step and the schedule.
        Loadable on any device: load_state_dict maps tensors to the EMA's own."""
        self._ready("state_dict")
        weights = {name: e.ema.detach() for e in self._binding.table.entries for name in e.names}
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "weights": weights,
            "step": self._schedule.step.detach(),
            "schedule": self.schedule,
            "rounding": dict(self._rounding),
            "buffers": self.buffers,
        }

    def load_state_dict(self, state, strict: bool = True) -> LoadResult:
        """Restores an EMA from `state` (or a file path): fused_ema's own state_dict, a model
        state dict, or a checkpoint of timm, AveragedModel, ema-pytorch, diffusers or torch_ema.

        Every key, shape, dtype, the step and the schedule are checked and the tensors moved to
        the EMA's devices before anything changes; all problems are reported in one
        CheckpointError and the EMA is left as it was. With strict=False what matches is loaded
        and the rest is reported in the returned LoadResult.
        """
        self._ready("load_state_dict")
        source = "checkpoint"
        if isinstance(state, (str, os.PathLike)):
            source = f"checkpoint file {os.fspath(state)!r}"
            try:
                state = read_file(state)
            except Exception as err:
                raise CheckpointError(
                    [f"could not read it: {type(err).__name__}: {err}"], source
                ) from err
        prepared = prepare_load(self._binding.table, state, strict, source, options_from_state)
        rounding = None
        if isinstance(state, dict) and state.get("format") == FORMAT and "rounding" in state:
            try:
                rounding = rounding_from_state(state["rounding"])
            except (TypeError, ValueError) as err:
                raise CheckpointError([f"rounding: {err}"], source) from err
        with torch.no_grad():
            copy_all([(None, value, entry.ema) for entry, value in prepared.values])
            self._schedule.load(prepared.options, prepared.step)
        if rounding is not None:
            self._rounding = rounding
            self._binding.set_seed(self._seed())
        self._warn_precision()
        return prepared.result

    # ------------------------------------------------------------------ diagnostics

    def stats(self, model: nn.Module | None = None) -> dict:
        """Health of the average (reads device tensors: not for the hot loop). For a sharded EMA
        the counts and distances cover this rank's shards.

        With `model`: the relative distance ||ema - model|| / ||model|| over averaged tensors, and
        the fraction of averaged elements that an update with the latest weight would leave
        unchanged because the change rounds away (near 1.0: the EMA has stopped moving).
        """
        self._ready("stats")
        model = unwrap_model(model) if model is not None else None
        return ema_stats(
            self._binding.table.entries, self.step, self.current_decay, self.decay, model
        )

    def full_state_dict(self, rank: int | None = 0, cpu_offload: bool = True) -> dict:
        """Whole, plain EMA tensors by name (a model state dict: ``model.load_state_dict`` takes
        it), for export or evaluation. A sharded (DTensor) EMA is gathered, which is a collective:
        every rank must call this. With `rank`, only that rank keeps the result and the others get
        {}; rank=None keeps it everywhere. `cpu_offload` returns CPU tensors."""
        self._ready("full_state_dict")
        return gather_full(self._binding.table.entries, rank, cpu_offload)

    def _warn_precision(self) -> None:
        low = {
            str(e.ema.dtype)
            for e in self._binding.table.entries
            if e.average and e.ema.dtype in _LOW_PRECISION
        }
        if low and self.decay > 0.99 and not self._rounding["stochastic_rounding"]:
            warnings.warn(
                f"fused_ema: a {', '.join(sorted(low))} EMA with decay {self.decay} loses most "
                f"updates to rounding: a step moves a weight by {1 - self.decay:.0e} of its "
                "distance to the model, below half an ulp of a 16-bit float for most entries, so "
                "they stop moving. Keep stochastic_rounding=True (the default), keep the EMA in "
                "float32 (dtype=None does that even for a 16-bit model) or lower the decay.",
                PrecisionWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ copies and pickling

    def __getstate__(self) -> dict:
        self.synchronize()
        if self._swapped:
            raise RuntimeError("a ModelEma cannot be copied or pickled inside ema.swapped()")
        return {k: v for k, v in self.__dict__.items() if k not in _TRANSIENT}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_transient()
        self._binding.rehook(self)

    def __repr__(self) -> str:
        sc = self._schedule.options
        where = str(self.device) if self.device is not None else "with the model"
        return (
            f"ModelEma({len(self._binding.table.entries)} tensors, decay={sc['decay']}, "
            f"device={where}, "
            f"buffers={self.buffers!r}, warmup={sc['warmup']}, "
            f"update_after_step={sc['update_after_step']}, update_every={sc['update_every']})"
        )


_TRANSIENT = ("_runner", "_pending_plan", "_swapped", "_key")
