"""ModelEma: a device-safe, fused exponential moving average of a model's weights.

A drop-in for timm's ModelEmaV3 (and AveragedModel, ema-pytorch, diffusers, torch_ema users): it
keeps shadow tensors keyed by name (no deepcopy of the model), decides at every update where each
side lives, copies across devices through reusable staging buffers, averages with one fused
kernel call per device, and restores checkpoints from any device and from the peers' formats.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Union

import torch
from torch import nn

from ._dtensor import (
    check_averageable,
    copy_into,
    full_value,
    is_dtensor,
    local,
    reshard_fsdp,
    sharding,
    unsharded_names,
)
from ._module_view import SwappedModelView
from ._plan import Slot, UpdatePlan, pair_supported
from ._tracking import PARAM, Tracked, named_tensors, tensor_walk, unwrap_model
from .checkpoint import FORMAT, FORMAT_VERSION, parse_checkpoint, read_file
from .errors import CheckpointError, PrecisionWarning, StructureMismatchError
from .ops import lerp_

BUFFER_MODES = ("average", "copy", "ignore")
MISMATCH_MODES = ("error", "resync")
DEFAULT_WARMUP = (1.0, 2.0 / 3.0)  # timm's and ema-pytorch's (gamma, power)
_LOW_PRECISION = (torch.bfloat16, torch.float16)

Device = Union[str, torch.device, None]


@dataclass
class _Entry:
    """One distinct model tensor followed by the EMA, under all its names."""

    names: list[str]
    kind: str
    ema: torch.Tensor  # an nn.Parameter (requires_grad=False) for parameters
    average: bool  # lerp toward the model, or copy it (integer buffers, buffers="copy")
    bound: weakref.ref  # the model tensor object it follows

    @property
    def name(self) -> str:
        return self.names[0]


class LoadResult(NamedTuple):
    """What load_state_dict matched; with strict=False the unmatched parts are listed here."""

    format: str
    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]


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
        on_mismatch: "error" raises when the model's named tensors were added, removed,
            reshaped or replaced; "resync" follows them (kept entries keep their average).
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
        self._schedule = _check_schedule(decay, min_decay, warmup, update_after_step, update_every)
        self.buffers = buffers
        self.on_mismatch = on_mismatch
        self._device = torch.device(device) if device is not None else None
        self._dtype = dtype
        self._plan: UpdatePlan | None = None
        self._swapped = False
        self._pending: Future | None = None  # a non_blocking update's worker job
        self._worker: ThreadPoolExecutor | None = None
        self._side_streams: dict = {}
        self._module: nn.Module | None = None

        model = unwrap_model(model)
        with torch.no_grad():
            self._entries = [self._new_entry(t) for t in self._named(model)]
        self._index_names()
        self._build_module(model)
        place = self._schedule_device()
        self._step = torch.zeros((), dtype=torch.int64, device=place)
        self._step_before = torch.zeros_like(self._step)  # restored if an update fails
        self._out = torch.zeros(2, dtype=torch.float64, device=place)  # (weight, decay)
        self._refresh_schedule_out()
        self._warn_precision()

    # ------------------------------------------------------------------ schedule and state

    @property
    def decay(self) -> float:
        """The configured per-step decay (the warmup ramps up to it)."""
        return self._schedule["decay"]

    @property
    def step(self) -> int:
        """Updates counted so far (or the last step passed to update). Reads a device tensor."""
        self.synchronize()
        return int(self._step.item())

    @property
    def current_decay(self) -> float:
        """The per-step decay of the latest step (0.0 while copying). Reads a device tensor."""
        self.synchronize()
        return float(self._out[1].item())

    @property
    def schedule(self) -> dict:
        return dict(self._schedule)

    @property
    def device(self) -> torch.device | None:
        return self._device

    def names(self) -> list[str]:
        """Every tracked name, tied weights under each of their names."""
        return [name for e in self._entries for name in e.names]

    # ------------------------------------------------------------------ updating

    def update(
        self, model: nn.Module, step: int | torch.Tensor | None = None, non_blocking: bool = False
    ) -> None:
        """One EMA step toward `model`'s current weights.

        `step` (an int or a tensor, e.g. the optimizer's step count from 1) drives warmup,
        update_after_step and update_every; without it the EMA counts its own updates. With
        model and EMA on one device this issues no host sync.

        `non_blocking=True` (for an EMA kept on the CPU) returns at once: the model's tensors are
        copied into pinned staging buffers on a side stream that the training stream waits for
        (so the next optimizer step cannot overwrite them first), and the CPU update runs on a
        worker thread. ema.synchronize() waits for it; so does every read of the EMA, and an
        error in the worker is raised by the next call.
        """
        if torch.compiler.is_compiling():
            return self._update_traced(unwrap_model(model), step)
        self._ready("update")
        model = unwrap_model(model)
        with torch.no_grad():
            walk = tensor_walk(model, self._with_buffers)
            plan = self._plan_for(model, walk, snapshot=non_blocking)
            undo = self._advance(step)
            try:
                if non_blocking:
                    self._start_async(plan, walk)
                else:
                    self._apply(model, walk, plan)
            except BaseException:
                undo()
                raise

    def synchronize(self) -> None:
        """Waits for a non_blocking update still running, raising the error it ended with."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _update_traced(self, model: nn.Module, step) -> None:
        """update() as torch.compile sees it: only tensor operations (the schedule op, one fused
        lerp per EMA device, a foreach copy), with the tensor pairing resolved while tracing.
        Dynamo guards on the model's structure, so a changed model is traced again."""
        sources = dict(model.named_parameters(remove_duplicate=False))
        sources.update(model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            if step is None:
                self._run_schedule(advance=True)
            else:
                if isinstance(step, torch.Tensor):
                    self._step.copy_(step.reshape(()))
                else:
                    self._step.fill_(step)
                self._run_schedule(advance=False)
            weight = self._out[0]
            emas: dict = {}
            srcs: dict = {}
            copy_emas, copy_srcs = [], []
            for entry in self._entries:
                ema, src = entry.ema, sources[entry.name].detach()
                if not entry.average:
                    copy_emas.append(ema)
                    copy_srcs.append(src.to(ema.device))
                    continue
                if src.device != ema.device or not pair_supported(ema.dtype, src.dtype):
                    src = src.to(device=ema.device, dtype=ema.dtype)
                emas.setdefault(ema.device, []).append(ema)
                srcs.setdefault(ema.device, []).append(src)
            for device, ema_list in emas.items():
                lerp_(ema_list, srcs[device], self._weight_on(device, weight))
            if copy_emas:
                torch._foreach_copy_(copy_emas, copy_srcs)

    def _advance(self, step):
        """Moves the step counter and schedules this step's weight; returns how to undo it."""
        if step is None:
            self._run_schedule(advance=True)

            def undo():
                self._step.sub_(1)
                self._run_schedule(advance=False)

            return undo
        self._step_before.copy_(self._step)  # a kept buffer: no allocation per update
        if isinstance(step, torch.Tensor):
            if step.numel() != 1:
                raise ValueError(f"step must be a number, got a tensor of shape {list(step.shape)}")
            if step.device == self._step.device or step.device.type != "cpu":
                self._step.copy_(step.reshape(()))
            else:
                self._step.fill_(int(step.item()))  # a CPU tensor: no device sync
        else:
            if isinstance(step, bool) or int(step) != step:
                raise ValueError(f"step must be a whole number, got {step!r}")
            self._step.fill_(int(step))
        self._run_schedule(advance=False)

        def undo():
            self._step.copy_(self._step_before)
            self._run_schedule(advance=False)

        return undo

    def _run_schedule(self, advance: bool) -> None:
        sc = self._schedule
        gamma, power = sc["warmup"] if sc["warmup"] else (0.0, 1.0)
        values = (
            sc["decay"],
            sc["min_decay"],
            gamma,
            power,
            sc["update_after_step"],
            sc["update_every"],
        )
        # The config tensor is kept while the schedule and device stay (no copy per update, so
        # a CUDA-graph capture holds no host-to-device copy).
        cached = getattr(self, "_schedule_config", None)
        if cached is None or cached[0] != values or cached[1].device != self._step.device:
            config = torch.tensor(values, dtype=torch.float64, device=self._step.device)
            self._schedule_config = cached = (values, config)
        torch.ops.fused_ema.ema_schedule_(self._step, self._out, cached[1], advance)

    def _refresh_schedule_out(self) -> None:
        with torch.no_grad():
            self._run_schedule(advance=False)

    def _apply(self, model, walk, plan) -> None:
        """Runs the plan; if the model moved or changed dtype meanwhile, replans and finishes."""
        done: set = set()
        try:
            self._run_plan(plan, walk, done)
        except (RuntimeError, ValueError):
            if not plan.placement_changed(walk):
                raise
            self._plan = None
            self._run_plan(self._plan_for(model, walk), walk, done)

    def _run_plan(self, plan: UpdatePlan, walk, done: set) -> None:
        weight = self._out[0]
        skipped = False
        if plan.has_staging and weight.device.type == "cpu" and not torch.compiler.is_compiling():
            # Cross-device copies are not free: look at the (host) weight and skip them on the
            # steps update_every leaves out. Same-device updates never read it in Python.
            skipped = float(weight) == 0.0
        for device, group in plan.groups.items():
            if device in done or skipped:
                continue
            self._run_group(plan, group, walk, weight)
            done.add(device)
        self._copy_unaveraged(plan, walk)

    def _run_group(self, plan: UpdatePlan, group, walk, weight: torch.Tensor) -> None:
        """One EMA device's fused call, after copying its staged sources into place."""
        if group.staging:
            for view, i in zip(group.staging, group.staged_index):
                view.copy_(local(walk[i]), non_blocking=True)
            for cuda_device in group.wait_for:
                # copies into pinned host memory must land before the CPU kernel reads them
                torch.cuda.current_stream(cuda_device).synchronize()
        lerp_(group.ema, plan.sources(group, walk), self._weight_on(group.device, weight))

    @staticmethod
    def _copy_unaveraged(plan: UpdatePlan, walk) -> None:
        for emas, indices in plan.copies.values():
            torch._foreach_copy_(emas, [local(walk[i]) for i in indices])

    def _start_async(self, plan: UpdatePlan, walk) -> None:
        """Issues the copies of a non_blocking update and hands the CPU work to the worker."""
        weight = self._out[0]
        skipped = weight.device.type == "cpu" and float(weight) == 0.0  # a CPU read
        cpu_groups, copies = [], []
        for device, group in plan.groups.items():
            if device.type != "cpu":  # a device EMA updates in stream order anyway
                self._run_group(plan, group, walk, weight)
            elif not skipped:
                copies += group.staged_sources(walk)
                cpu_groups.append(group)
        copies += [(view, local(walk[i])) for _, i, view in plan.staged_copies]
        self._copy_unaveraged(plan, walk)
        if not cpu_groups and not plan.staged_copies:
            return
        events = self._issue_copies(copies)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused_ema")
        self._pending = self._worker.submit(
            _finish_async, cpu_groups, plan.staged_copies, events, weight
        )

    def _issue_copies(self, copies) -> list:
        """Starts the copies into staging: CPU sources at once, GPU sources on a side stream that
        first waits for the training stream; the training stream then waits for the copies, so
        no later kernel (the next optimizer step) writes a weight before it has been read."""
        events, by_device = [], {}
        for view, src in copies:
            if src.device.type == "cuda":
                by_device.setdefault(src.device, []).append((view, src))
            else:
                view.copy_(src)
        for device, pairs in by_device.items():
            current = torch.cuda.current_stream(device)
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for view, src in pairs:
                    view.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            current.wait_event(done)
            events.append(done)
        return events

    @staticmethod
    def _weight_on(device: torch.device, weight: torch.Tensor) -> torch.Tensor:
        if weight.device.type == "cpu" or weight.device == device:
            return weight  # the kernel reads a CPU weight on the host, for any device
        # A device weight for another device: a copy, and a host sync when that is the CPU.
        return weight.to(device)

    # ------------------------------------------------------------------ structure

    @property
    def _with_buffers(self) -> bool:
        return self.buffers != "ignore"

    def _named(self, model: nn.Module) -> list[Tracked]:
        return named_tensors(model, self._with_buffers)

    def _new_entry(self, tracked: Tracked) -> _Entry:
        t = tracked.tensor.detach()
        average = t.is_floating_point() and (tracked.kind == PARAM or self.buffers == "average")
        if not average:
            dtype = t.dtype
        elif self._dtype is not None:
            dtype = self._dtype
        else:
            dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        if is_dtensor(t):
            # A shard stays a shard: same mesh and placements, averaged where it lies.
            check_averageable(tracked.name, t)
            if self._device is not None and self._device != t.device:
                raise ValueError(
                    f"{tracked.name} is sharded (a DTensor on {t.device}); its EMA lives with its "
                    f"shard, so device={str(self._device)!r} cannot apply. Build the EMA with "
                    "device=None, and gather it with ema.full_state_dict() where needed."
                )
            device = t.device
        else:
            device = self._device if self._device is not None else t.device
        ema = t.to(device=device, dtype=dtype, copy=True)
        if tracked.kind == PARAM:
            ema = nn.Parameter(ema, requires_grad=False)
        return _Entry(list(tracked.names), tracked.kind, ema, average, weakref.ref(tracked.tensor))

    def _index_names(self) -> None:
        self._by_name = {name: e for e in self._entries for name in e.names}

    def _plan_for(self, model, walk, snapshot: bool = False) -> UpdatePlan:
        plan = self._plan
        if plan is not None and plan.matches(walk):
            if plan.snapshot == snapshot:
                return plan
            self._plan = self._build_plan(walk, snapshot)
            return self._plan
        tracked = self._named(model)
        self._refuse_unsharded(tracked)
        mismatch = self._mismatch(tracked)
        if mismatch:
            if self.on_mismatch == "error":
                raise mismatch
            self._resync(tracked, model)
        self._rebind(tracked)
        self._plan = self._build_plan(walk, snapshot)
        return self._plan

    def _refuse_unsharded(self, tracked: list[Tracked]) -> None:
        pairs = [
            (n, self._by_name[n].ema, t.tensor)
            for t in tracked
            for n in t.names
            if n in self._by_name
        ]
        names = unsharded_names(pairs)
        if names:
            raise RuntimeError(
                f"{len(names)} sharded tensors of the model are unsharded right now (e.g. "
                f"{names[0]}): an FSDP2 model between forward and backward, or after an "
                "evaluation forward. Update the EMA after optimizer.step(), or call "
                "model.reshard() first."
            )

    def _mismatch(self, tracked: list[Tracked]) -> StructureMismatchError:
        current = {name: t for t in tracked for name in t.names}
        added = [n for n in current if n not in self._by_name]
        removed = [n for n in self._by_name if n not in current]
        reshaped, replaced = [], []
        for name, t in current.items():
            entry = self._by_name.get(name)
            if entry is None:
                continue
            if tuple(t.tensor.shape) != tuple(entry.ema.shape):
                reshaped.append(
                    f"{name} (EMA {list(entry.ema.shape)}, model {list(t.tensor.shape)})"
                )
            elif entry.kind != t.kind or (t.kind == PARAM and entry.bound() is not t.tensor):
                # Buffers are new objects after every model.to()/.float(): those are followed.
                replaced.append(name)
        return StructureMismatchError(
            added,
            removed,
            reshaped,
            replaced,
            hint="Call ema.resync(model) to follow the model (unchanged and replaced entries "
            "keep their average, new or reshaped ones start from the model), or build the EMA "
            "with on_mismatch='resync'.",
        )

    def _resync(self, tracked: list[Tracked], model: nn.Module) -> None:
        """Follows `tracked`: entries matching by name and shape keep their EMA tensor (a copy
        of it if a tied weight was untied), the others start from the model."""
        entries, used = [], set()
        with torch.no_grad():
            for t in tracked:
                old = next(
                    (
                        self._by_name[n]
                        for n in t.names
                        if n in self._by_name
                        and tuple(self._by_name[n].ema.shape) == tuple(t.tensor.shape)
                        and self._by_name[n].kind == t.kind
                    ),
                    None,
                )
                if old is None:
                    entries.append(self._new_entry(t))
                    continue
                ema = old.ema
                if id(ema) in used:
                    ema = (
                        nn.Parameter(ema.detach().clone(), False)
                        if t.kind == PARAM
                        else ema.clone()
                    )
                used.add(id(ema))
                entries.append(
                    _Entry(list(t.names), t.kind, ema, old.average, weakref.ref(t.tensor))
                )
        self._entries = entries
        self._index_names()
        self._plan = None
        self._build_module(model)

    def _rebind(self, tracked: list[Tracked]) -> None:
        for t in tracked:
            self._by_name[t.name].bound = weakref.ref(t.tensor)

    def _build_plan(self, walk, snapshot: bool = False) -> UpdatePlan:
        position = {}
        for i, t in enumerate(walk):
            position.setdefault(id(t), i)
        slots = []
        for entry in self._entries:
            src = entry.bound()
            index = position[id(src)]
            if self._device is None and not is_dtensor(src) and entry.ema.device != src.device:
                entry.ema.data = entry.ema.data.to(src.device)  # follow the model (same object)
            slots.append(Slot(entry.ema, index, entry.average))
        self._place_schedule()
        return UpdatePlan(slots, walk, snapshot)

    def _schedule_device(self) -> torch.device:
        for entry in self._entries:
            if local(entry.ema).device.type != "cpu":
                return local(entry.ema).device
        return torch.device("cpu")

    def _place_schedule(self) -> None:
        place = self._schedule_device()
        if self._step.device != place:
            self._step = self._step.to(place)
            self._step_before = torch.zeros_like(self._step)
            self._out = self._out.to(place)

    def resync(self, model: nn.Module) -> None:
        """Follows the model's current named tensors: unchanged (and same-shape replaced)
        entries keep their average, new or reshaped ones start from the model, removed ones go."""
        self._ready("resync")
        model = unwrap_model(model)
        tracked = self._named(model)
        self._resync(tracked, model)
        self._rebind(tracked)

    # ------------------------------------------------------------------ using the average

    @property
    def module(self) -> nn.Module:
        """An nn.Module in eval mode evaluating the EMA weights. Normally the model's structure
        (copied without its tensors) with the EMA tensors as its weights: shared, not stored twice.
        For a model deepcopy refuses (FSDP2, or one holding locks or handles) it runs the model
        itself with the EMA swapped in for each call (see swapped())."""
        self.synchronize()
        return self._module

    def _build_module(self, model: nn.Module) -> None:
        """Copies the model's module tree with the EMA tensors standing in for its own (a deepcopy
        whose memo already holds them), so no weight is copied or stored twice."""
        memo = {}
        for entry in self._entries:
            source = entry.bound()
            if source is not None:
                memo[id(source)] = entry.ema
        try:
            self._module = copy.deepcopy(model, memo).eval().requires_grad_(False)
        except Exception:  # FSDP2, or something else deepcopy cannot copy
            self._module = SwappedModelView(self, model)
            return
        # A forward through a module fetched before a non_blocking update waits for that update.
        self._module.register_forward_pre_hook(lambda *_: self.synchronize())

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        """Puts the EMA weights into `model`'s own tensors for the block and restores them after,
        also when the block raises. The tensors stay the same objects at the same addresses, so
        optimizers, hooks and compiled graphs see the EMA weights."""
        self._ready("swapped")
        model = unwrap_model(model)
        pairs = self._pairs_with(model)
        exchanged, saved = [], []
        with torch.no_grad():
            for entry, model_tensor in pairs:
                target, ema = local(model_tensor), local(entry.ema)
                if target.dtype == ema.dtype and target.device == ema.device:
                    _exchange(target, ema)
                    exchanged.append((ema, target))
                else:
                    saved.append((target, target.clone()))
                    target.copy_(ema)
        self._swapped = True
        try:
            yield model
        finally:
            with torch.no_grad():
                for ema, target in exchanged:
                    _exchange(target, ema)
                for target, original in saved:
                    target.copy_(original)
            # FSDP2 keeps parameters it gathered inside the block: they hold the EMA's weights.
            reshard_fsdp(model)
            self._swapped = False

    def copy_to(self, model: nn.Module) -> None:
        """Writes the EMA weights into `model` (matched by name, cast to its dtypes/devices)."""
        self._ready("copy_to")
        with torch.no_grad():
            for entry, target in self._pairs_with(unwrap_model(model)):
                copy_into(target, entry.ema)

    def _pairs_with(self, model: nn.Module) -> list[tuple[_Entry, torch.Tensor]]:
        tracked = self._named(model)
        self._refuse_unsharded(tracked)
        current = {name: t for t in tracked for name in t.names}
        missing = [e.name for e in self._entries if e.name not in current]
        extra = [n for n in current if n not in self._by_name]
        reshaped = [
            e.name
            for e in self._entries
            if e.name in current
            and (
                tuple(current[e.name].tensor.shape) != tuple(e.ema.shape)
                or sharding(current[e.name].tensor) != sharding(e.ema)
            )
        ]
        if missing or extra or reshaped:
            raise StructureMismatchError(
                extra, missing, reshaped, hint="Call ema.resync(model) first."
            )
        return [(e, current[e.name].tensor) for e in self._entries]

    def _ready(self, what: str) -> None:
        """Before any use of the EMA: a non_blocking update finished, and not inside swapped()."""
        self.synchronize()
        if self._swapped:
            raise RuntimeError(
                f"ema.{what}() inside `with ema.swapped(model)`: the EMA tensors "
                "hold the model's weights until the block ends"
            )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Names -> EMA tensors (tied weights under each name), the step and the schedule.
        Loadable on any device: load_state_dict maps tensors to the EMA's own."""
        self._ready("state_dict")
        weights = {name: e.ema.detach() for e in self._entries for name in e.names}
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "weights": weights,
            "step": self._step.detach(),
            "schedule": self.schedule,
            "buffers": self.buffers,
        }

    def load_state_dict(self, state, strict: bool = True) -> LoadResult:
        """Restores an EMA from `state` (or a file path): fused_ema's own state_dict, a model
        state dict, or a checkpoint of timm, AveragedModel, ema-pytorch, diffusers or torch_ema.

        Every key, shape and dtype is checked before anything changes; all problems are reported
        in one CheckpointError and the EMA is left as it was. With strict=False what matches is
        loaded and the rest is reported in the returned LoadResult.
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
        parsed = parse_checkpoint(state)
        fatal = list(parsed.problems)  # nothing can be loaded while any of these stands
        weights = parsed.weights
        if parsed.positional is not None:
            weights = self._positional(parsed.positional, fatal)
        schedule = None
        if parsed.schedule is not None:
            try:
                schedule = _check_schedule(**_schedule_args(parsed.schedule))
            except (TypeError, ValueError) as err:
                fatal.append(f"schedule: {err}")
        pairs, tensor_problems, missing, unexpected, mismatched = self._match(weights or {})
        if fatal or (strict and (tensor_problems or missing or unexpected)):
            listed = fatal + tensor_problems
            if strict:
                listed += [f"missing from the checkpoint: {k}" for k in missing]
                listed += [f"not in this EMA: {k}" for k in unexpected]
            raise CheckpointError(listed, source)
        with torch.no_grad():
            for entry, tensor in pairs:
                copy_into(entry.ema, tensor)
            if parsed.step is not None:
                self._step.fill_(parsed.step)
            if schedule is not None:
                self._schedule = schedule
            self._refresh_schedule_out()
        self._warn_precision()
        return LoadResult(parsed.format, missing, unexpected, mismatched)

    def _positional(self, tensors: list, problems: list[str]) -> dict:
        params = [e for e in self._entries if e.kind == PARAM]
        if len(tensors) != len(params):
            problems.append(
                f"it holds {len(tensors)} parameters in order but the model has {len(params)}"
            )
            return {}
        return {e.name: t for e, t in zip(params, tensors)}

    def _match(self, weights: dict):
        """Pairs checkpoint tensors with entries, collecting every problem instead of stopping.
        A tied weight needs only one of its names in the checkpoint."""
        pairs, problems, mismatched, covered = [], [], [], set()
        for name, tensor in weights.items():
            entry = self._by_name.get(name)
            if entry is None or id(entry) in covered:
                continue
            covered.add(id(entry))
            problem = _tensor_problem(name, tensor, entry.ema)
            if problem:
                problems.append(problem)
                mismatched.append(name)
            else:
                pairs.append((entry, tensor))
        missing = [e.name for e in self._entries if id(e) not in covered]
        unexpected = [k for k in weights if k not in self._by_name]
        return pairs, problems, missing, unexpected, mismatched

    # ------------------------------------------------------------------ diagnostics

    def stats(self, model: nn.Module | None = None) -> dict:
        """Health of the average (reads device tensors: not for the hot loop). For a sharded EMA
        the counts and distances cover this rank's shards.

        With `model`: the relative distance ||ema - model|| / ||model|| over averaged tensors, and
        the fraction of averaged elements that an update with the latest weight would leave
        unchanged because the change rounds away (near 1.0: the EMA has stopped moving).
        """
        self._ready("stats")
        averaged = [e for e in self._entries if e.average]
        decay = self.current_decay
        stats = {
            "step": self.step,
            "decay": decay,
            "window": math.inf if decay >= 1.0 else 1.0 / (1.0 - decay),
            "tracked": len(self._entries),
            "averaged": len(averaged),
            "copied": len(self._entries) - len(averaged),
            "ema_nan": sum(int(local(e.ema).isnan().sum()) for e in averaged),
            "ema_inf": sum(int(local(e.ema).isinf().sum()) for e in averaged),
        }
        if model is None:
            return stats
        model = unwrap_model(model)
        current = {n: t for t in named_tensors(model, True) for n in t.names}
        stats["untracked"] = sum(1 for n in current if n not in self._by_name)
        weight = 1.0 - (decay or self.decay)
        diff2 = ref2 = 0.0
        unchanged = total = 0
        with torch.no_grad():
            for e in averaged:
                m = current.get(e.name)
                if (
                    m is None
                    or m.tensor.shape != e.ema.shape
                    or sharding(m.tensor) != sharding(e.ema)
                ):
                    continue
                ema = local(e.ema)
                src = local(m.tensor).detach().to(ema.device)
                diff2 += float((ema.double() - src.double()).square().sum())
                ref2 += float(src.double().square().sum())
                moved = ema.clone()
                lerp_([moved], [src.to(ema.dtype)], weight)
                unchanged += int((moved == ema).sum())
                total += ema.numel()
            stats["model_nan"] = sum(
                int(local(t.tensor).isnan().sum())
                for t in current.values()
                if t.tensor.is_floating_point()
            )
        stats["relative_distance"] = math.sqrt(diff2 / ref2) if ref2 > 0 else 0.0
        stats["unchanged_fraction"] = unchanged / total if total else 0.0
        return stats

    def full_state_dict(self, rank: int | None = 0, cpu_offload: bool = True) -> dict:
        """Whole, plain EMA tensors by name (a model state dict: ``model.load_state_dict`` takes
        it), for export or evaluation. A sharded (DTensor) EMA is gathered, which is a collective:
        every rank must call this. With `rank`, only that rank keeps the result and the others get
        {}; rank=None keeps it everywhere. `cpu_offload` returns CPU tensors."""
        self._ready("full_state_dict")
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        keep = rank is None or not distributed or dist.get_rank() == rank
        out = {}
        with torch.no_grad():
            for entry in self._entries:
                value = full_value(entry.ema.detach())  # every rank joins the gather
                if not keep:
                    continue
                value = value.to("cpu") if cpu_offload else value
                if (
                    value.untyped_storage().data_ptr()
                    == local(entry.ema).untyped_storage().data_ptr()
                ):
                    value = value.clone()  # a copy, never the live EMA
                for name in entry.names:
                    out[name] = value
        return out

    def _warn_precision(self) -> None:
        low = sorted(
            {str(e.ema.dtype) for e in self._entries if e.average and e.ema.dtype in _LOW_PRECISION}
        )
        if low and self.decay > 0.99:
            warnings.warn(
                f"fused_ema: a {', '.join(low)} EMA with decay {self.decay} loses most updates to "
                f"rounding: a step moves a weight by {1 - self.decay:.0e} of its distance to the "
                "model, below half an ulp of a 16-bit float for most entries, so they stop "
                "moving. Keep the EMA in float32 (dtype=None, the default, does that even for a "
                "16-bit model) or lower the decay.",
                PrecisionWarning,
                stacklevel=3,
            )

    def __repr__(self) -> str:
        sc = self._schedule
        where = str(self._device) if self._device is not None else "with the model"
        return (
            f"ModelEma({len(self._entries)} tensors, decay={sc['decay']}, device={where}, "
            f"buffers={self.buffers!r}, warmup={sc['warmup']}, "
            f"update_after_step={sc['update_after_step']}, "
            f"update_every={sc['update_every']})"
        )


def _finish_async(groups, staged_copies, events, weight) -> None:
    """The worker's half of a non_blocking update: wait for the copies, then average on the CPU."""
    for event in events:
        event.synchronize()
    for group in groups:
        lerp_(group.ema, group.staging, weight)
    for ema, _, view in staged_copies:
        ema.copy_(view)


def _exchange(a: torch.Tensor, b: torch.Tensor) -> None:
    scratch = a.clone()
    a.copy_(b)
    b.copy_(scratch)


def _tensor_problem(name: str, tensor, ema: torch.Tensor) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"{name}: expected a tensor, got {type(tensor).__name__}"
    if tensor.is_meta:
        return f"{name}: a meta tensor holds no values"
    if tuple(tensor.shape) != tuple(ema.shape):
        return f"{name}: shape {list(tensor.shape)} does not match the EMA's {list(ema.shape)}"
    if tensor.is_floating_point() != ema.is_floating_point() or tensor.is_complex():
        return f"{name}: dtype {tensor.dtype} cannot be stored in the EMA's {ema.dtype}"
    return None


def _check_schedule(decay, min_decay=0.0, warmup=False, update_after_step=0, update_every=1):
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be a number in [0, 1], got {decay!r}")
    if not isinstance(min_decay, (int, float)) or not 0.0 <= min_decay <= decay:
        raise ValueError(f"min_decay must be in [0, decay], got {min_decay!r}")
    if warmup is True:
        warmup = DEFAULT_WARMUP
    if warmup is False or warmup is None:
        warmup = None
    else:
        try:
            gamma, power = (float(v) for v in warmup)
        except (TypeError, ValueError):
            raise ValueError(
                f"warmup must be False, True or (gamma, power), got {warmup!r}"
            ) from None
        if not (gamma > 0 and power > 0):
            raise ValueError(f"warmup gamma and power must be positive, got {warmup!r}")
        warmup = (gamma, power)
    for label, value, low in (
        ("update_after_step", update_after_step, 0),
        ("update_every", update_every, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{label} must be an integer >= {low}, got {value!r}")
    return {
        "decay": float(decay),
        "min_decay": float(min_decay),
        "warmup": warmup,
        "update_after_step": update_after_step,
        "update_every": update_every,
    }


def _schedule_args(schedule) -> dict:
    if not isinstance(schedule, dict):
        raise TypeError(f"expected a dict, got {type(schedule).__name__}")
    known = ("decay", "min_decay", "warmup", "update_after_step", "update_every")
    unknown = sorted(set(schedule) - set(known))
    if unknown:
        raise ValueError(f"unknown schedule keys {unknown}")
    return {k: schedule[k] for k in known if k in schedule}
