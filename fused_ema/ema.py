"""ModelEma: a device-safe, fused exponential moving average of a model's weights.

The public façade over the layers that own state (docs/internals.md maps them). Any public call
that raises leaves the EMA (tensors, step, schedule) and the model as they were."""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch
from torch import nn

from ._dist.shard import gather_full
from ._model.swap import check_writable, copy_all
from ._model.walk import unwrap_model
from ._state.ema_state import EmaState, rounding_seed
from ._state.loading import LoadResult
from ._state.options import resolve_options
from ._state.placement import MovedByTo, move, parse_to
from ._state.stats import ema_stats
from ._state.timm_attributes import TimmAttributes
from ._update import compiled
from ._update.attach import attach
from ._update.binding import Binding
from ._update.schedule import Schedule
from ._update.updater import Updater

__all__ = ["LoadResult", "ModelEma"]


class ModelEma(TimmAttributes, MovedByTo, nn.Module):
    """Exponential moving average of a model's parameters and buffers.

    The arguments up to ``exclude_buffers`` are timm ModelEmaV3's (1.0.31), in its order; the
    rest are keyword-only. An nn.Module like V3 (``ema(x)``, ``.eval()``, ``.to()``...) that
    registers no parameters, buffers or submodules of its own: a module holding it never hands
    the EMA to an optimizer, DDP or FSDP.

    Args:
        model: the module to follow (DDP / DataParallel / torch.compile wrappers are unwrapped).
        decay: per-step decay; the update is ``ema += (1 - decay) * (model - ema)``.
        min_decay: lower bound of the warmup decay.
        update_after_step: steps up to ``update_after_step + 1`` copy the model.
        use_warmup, warmup_gamma, warmup_power: timm's spelling of ``warmup=(gamma, power)``
            (None: not given, ``warmup=`` decides).
        device: None keeps each EMA tensor with its model tensor (following it if it moves);
            "cpu", "cuda:1", ... keeps the whole EMA there and copies model tensors across.
        dtype: EMA dtype for floating tensors; None means float32 for 16/32-bit weights and
            float64 for float64 ones.
        stochastic_rounding, stochastic_rounding_seed: bfloat16/float16 EMA tensors (dtype=)
            are rounded stochastically, so that updates below their resolution still move them
            in expectation (timm 1.0.31's keywords and default). The random bits depend on the
            seed, the step, the tensor's name and each element's index in the full tensor only:
            every DDP rank, every FSDP2 shard layout and a resumed run give the same bits.
        foreach: timm's option, accepted and ignored (the update is always fused).
        exclude_buffers: timm's option: True copies buffers instead of averaging them
            (``buffers="copy"``).
        buffers: "average" float buffers and copy the others (num_batches_tracked stays exact),
            "copy" every buffer, or "ignore" buffers.
        warmup: False, True (gamma=1, power=2/3) or (gamma, power): the decay of averaging step
            s is ``min(decay, max(min_decay, 1 - (1 + s / gamma) ** -power))``; "diffusers":
            ``(1 + s) / (10 + s)`` instead (diffusers' use_ema_warmup=False); "torch_ema": that
            ramp counted from the first update, which averages too (torch_ema's num_updates);
            ``("power_function", gamma)``: EDM2's power-function EMA, decay
            ``(1 - 1 / t) ** (gamma + 1)`` at the t-th update counted from the copy (t = s + 1;
            ema-pytorch's KarrasEMA), capped by ``decay`` (use decay=1.0).
        update_every: update on steps 1, 1 + k, 1 + 2k, ... with ``decay ** k`` (or ``decay``:
            see update_every_decay).
        on_mismatch: "error" raises when the model's tensors were added, removed, renamed,
            reshaped or replaced; "resync" follows them (kept tensors keep their average).
        shard: True (the default process group), a ProcessGroup or a 1-D DeviceMesh: for a
            model replicated across those ranks (DDP), each rank keeps only its chunk of every
            averaged tensor (a DTensor), updated from its own replica with no communication;
            swapped(), copy_to(), module and full_state_dict() gather (collectives: every rank
            calls them). Build it on every rank, after wrapping the model in DDP.
        update_every_decay: "compensated" (``decay ** update_every`` per update, the same average
            as updating every step) or "plain" (``decay``, as ema-pytorch and Lightning do).
        copy_names, ignore_names: tensors to copy from the model instead of averaging, or to leave
            out of the EMA, by exact name, module name ("head" covers "head.weight") or fnmatch
            glob ("*.running_*"). param_or_buffer_names_no_ema and ignore_startswith_names
            (ema-pytorch's spellings) add to them.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_warmup: bool | None = None,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2.0 / 3.0,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        stochastic_rounding: bool = True,
        stochastic_rounding_seed: int = 0,
        foreach: bool | None = None,  # noqa: ARG002  (timm's option; always fused here)
        exclude_buffers: bool | None = None,
        *,
        buffers: str = "average",
        warmup=False,
        update_every: int = 1,
        on_mismatch: str = "error",
        shard=False,
        update_every_decay: str = "compensated",
        copy_names=None,
        ignore_names=None,
        param_or_buffer_names_no_ema=None,
        ignore_startswith_names=None,
    ):
        super().__init__()
        self.training = False  # the EMA module evaluates: eval mode until ema.train()
        names = (copy_names, ignore_names, param_or_buffer_names_no_ema, ignore_startswith_names)
        schedule, rounding, policy = resolve_options(
            warmup=(warmup, use_warmup, warmup_gamma, warmup_power),
            buffers=(buffers, exclude_buffers),
            schedule=(decay, min_decay, update_after_step, update_every, update_every_decay),
            rounding=(stochastic_rounding, stochastic_rounding_seed),
            policy=(device, dtype, names, shard),
            on_mismatch=on_mismatch,
        )
        model = unwrap_model(model)
        self._binding = Binding(self, model, policy, on_mismatch, rounding_seed(rounding))
        self._schedule = Schedule(schedule, self._binding.schedule_device())
        self._state = EmaState(self._binding, self._schedule, rounding)
        self._init_transient()
        self._state.warn_precision()

    def _init_transient(self) -> None:
        """The state no copy or pickle carries: rebuilt from the rest when needed."""
        self._updater = Updater(self._binding, self._schedule)
        self._key = compiled.register(self)
        self._hooks = weakref.WeakSet()  # attach(): the optimizer hooks still registered

    # ------------------------------------------------------------------ schedule and state

    @property
    def step(self) -> int:
        """Updates counted so far (or the last step passed to update). Reads a device tensor."""
        self.synchronize()
        return self._schedule.value()

    @step.setter
    def step(self, value) -> None:
        """Sets the counter (a whole number in [0, MAX_STEP] or an integer tensor, checked like
        update(step=)): the next update without a step is step value + 1."""
        self._refuse_in_set("ema.step = ...", "set")
        self._ready("step setter")
        self._schedule.load(None, self._schedule.as_value(value))

    def _set_option(self, key: str, value) -> None:
        self._refuse_in_set(f"ema.{key} = ...", "set")
        super()._set_option(key, value)

    @property
    def current_decay(self) -> float:
        """The per-step decay of the latest step (0.0 while copying). Reads a device tensor."""
        self.synchronize()
        return self._schedule.current_decay()

    @property
    def schedule(self) -> dict:
        return dict(self._schedule.options)

    def get_decay(self, step: int | torch.Tensor | None = None) -> float:
        """timm ModelEmaV3.get_decay: the per-step decay of `step` (0.0 while it copies the
        model, the warmup's value while warming up), computed by the same formula the update runs;
        without a step, the configured decay. With update_every=k, an update step applies
        ``decay ** k`` of this value (and the steps between average nothing)."""
        return self.decay if step is None else self._schedule.decay_at(step)

    @property
    def device(self) -> torch.device | None:
        return self._binding.policy.device

    @property
    def buffer_mode(self) -> str:
        """The buffers= mode: "average", "copy" or "ignore". (``ema.buffers()`` is nn.Module's:
        the EMA registers none.)"""
        return self._binding.policy.buffers

    @property
    def on_mismatch(self) -> str:
        return self._binding.on_mismatch

    def names(self) -> list[str]:
        """Every tracked name, tied weights under each of their names."""
        return list(self._binding.table.by_name)  # in the entries' order

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
        self._refuse_in_set("update", "update")
        self._update(model, step, non_blocking)

    def _update(self, model: nn.Module, step, non_blocking: bool) -> None:
        """update() itself: what a PostHocEma's or Bema's update runs on its leading track."""
        if not isinstance(non_blocking, bool):  # as attach(): "no" would read as True
            raise TypeError(f"non_blocking must be True or False, got {non_blocking!r}")
        if torch.compiler.is_compiling():
            return self._updater.trace(unwrap_model(model), step, self._key)
        self._updater.update(self, unwrap_model(model), step, non_blocking)

    def synchronize(self) -> None:
        """Waits for a non_blocking update still running, raising the error it ended with (the
        step then reads as before that update, which wrote nothing)."""
        self._updater.synchronize()

    def resync(self, model: nn.Module) -> None:
        """Follows the model's current tensors: each keeps its average under its current names
        (matched by identity, then by name and shape), new or reshaped ones start from the model,
        removed ones go."""
        self._refuse_in_set("resync", "update")
        self._resync(model)

    def _resync(self, model: nn.Module, undos: list | None = None) -> None:
        """resync() itself; a set's resync() runs it on every track, with their `undos`."""
        self._ready("resync")
        self._state.warn_precision()
        with self._updater.exclusive("ema.resync()"):
            self._binding.resync(self, unwrap_model(model), self._schedule, undos)

    def set(self, model: nn.Module) -> None:
        """timm ModelEmaV3.set: copies the model's current weights into the EMA (cast to its
        dtypes and devices); the step and schedule stay. The model must match the EMA's names and
        shapes (checked before anything is written)."""
        self._ready("set")
        with self._updater.exclusive("ema.set()"):
            pairs = self._binding.pairs_with(unwrap_model(model))
            copy_all([(name, target, ema) for name, ema, target in pairs])

    def attach(self, optimizer, model: nn.Module | None = None, *, non_blocking: bool = False):
        """Updates the EMA after every ``optimizer.step()`` (a step post-hook) and returns the
        hook's handle: ``handle.remove()`` detaches. The EMA counts its own updates (ema.step,
        restored by load_state_dict), so it equals the number of optimizer steps taken while
        attached. Steps a GradScaler skips (inf/NaN gradients) are not counted. `model` defaults
        to the model the EMA follows (the one of its latest update or resync); both are held
        weakly. One optimizer at a time: a second attach raises until the first is removed."""
        self._refuse_in_set("attach", "update")
        return attach(self, optimizer, model, non_blocking, self._hooks)

    # ------------------------------------------------------------------ nn.Module behaviour

    def forward(self, *args, **kwargs):
        """Runs ema.module: the model's forward with the EMA weights (timm's ``model_ema(x)``)."""
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> ModelEma:
        """Sets the training mode of ema.module (eval by default); ``ema.eval()`` calls this."""
        super().train(mode)  # checks `mode`: the EMA has no children of its own
        if self._binding.module is not None:
            self._binding.module.train(mode)
        return self

    def to(self, *args, **kwargs) -> ModelEma:
        """Moves the whole EMA (every tensor, the step counter, ema.module) to a device and/or
        converts its averaged tensors to a floating dtype, as if built with that device= /
        dtype=: ``ema.to("cpu")``, ``ema.to("cuda:1", torch.float32)``, ``ema.to(tensor)``. All
        or nothing. A sharded (DTensor) EMA cannot move."""
        self._refuse_in_set("ema.to()", "move")
        return self._to(*args, **kwargs)

    def _to(self, *args, **kwargs) -> ModelEma:
        device, dtype, non_blocking = parse_to(args, kwargs)
        self._ready("to")
        if dtype is not None:
            self._state.warn_precision(dtype=dtype)
        with self._updater.exclusive("ema.to()"):
            move(self, self._binding, self._schedule, device, dtype, non_blocking)
        return self

    def share_memory(self) -> ModelEma:
        """Moves the EMA's CPU tensors (ema.module's) to shared memory, for torch.multiprocessing
        (nn.Module's went through _apply, which leaves the EMA as it is)."""
        self.module.share_memory()
        return self

    def _refuse_in_set(self, what: str, why: str) -> None:
        """Refuses ema.`what` on a track of a PostHocEma or Bema, before anything changes: the
        tracks are one object, updated together ("update": by the set's update(), which also
        writes a PostHocEma's snapshots) with one schedule and step ("set"), and a track moved or
        configured alone leaves the others behind (the set's checkpoint then cannot be loaded)."""
        kind = self._updater.owner
        if kind is None:
            return
        if why == "move":
            raise RuntimeError(
                f"fused_ema: {what} on one of a {kind}'s tracks: they move and convert together "
                f"(the {kind}'s to()); nothing was changed"
            )
        if why == "update":
            raise RuntimeError(
                f"fused_ema: ema.{what}() on one of a {kind}'s tracks: they update together, "
                f"by the {kind}'s update(model) (call it after optimizer.step()); nothing was "
                "changed"
            )
        raise RuntimeError(
            f"fused_ema: {what} on one of a {kind}'s tracks: the tracks share one schedule and "
            f"step, given by the {kind} (build the {kind} with the schedule wanted, or load its "
            "checkpoint); nothing was changed"
        )

    def _ready(self, what: str) -> None:
        """Before any use of the EMA: a non_blocking update finished, and not inside swapped()."""
        self._updater.ready(what)

    # ------------------------------------------------------------------ using the average

    @property
    def module(self) -> nn.Module:
        """An nn.Module in eval mode evaluating the EMA weights: the model's structure (copied
        without its tensors) with the EMA tensors as its weights, shared, not stored twice, and
        the model's own non-persistent buffers (one copy on the EMA's device where the EMA lives
        on another). For a model deepcopy refuses (FSDP2, locks, handles) it runs the model
        itself with the EMA swapped in for each call (see swapped()). Refused inside swapped(),
        where its tensors hold the model's weights (its state_dict() would save those)."""
        self._updater.ready(
            error="ema.module inside `with ema.swapped(model)`: the EMA tensors hold the model's "
            "weights until the block ends (inside it, the model holds the EMA's)"
        )
        return self._binding.module_for(self)

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        """Puts the EMA weights into `model`'s own tensors for the block and restores them after,
        also when the block raises. The tensors stay the same objects at the same addresses, so
        optimizers, hooks and compiled graphs see the EMA weights. Tensors of the EMA's dtype and
        device are exchanged in place through a scratch buffer of at most 16 MiB per dtype and
        device; for others (a 16-bit model with a float32 EMA) the EMA's values are cast first,
        which costs their size. Each direction is one call, all or nothing."""
        self._ready("swapped")
        with self._updater.lend(unwrap_model(model)) as model:
            yield model

    def copy_to(self, model: nn.Module) -> None:
        """Writes the EMA weights into `model` (matched by name, cast to its dtypes/devices)."""
        self._ready("copy_to")
        with self._updater.exclusive("ema.copy_to()"):
            pairs = self._binding.pairs_with(unwrap_model(model))
            check_writable(pairs)
            copy_all(pairs)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Names -> EMA tensors (tied weights under each name), the step and the schedule.
        Loadable on any device: load_state_dict maps tensors to the EMA's own.

        A parent module's state_dict() (which passes destination= and prefix=) gets flat keys
        instead: ``{prefix}weights.{name}`` and ``{prefix}step``, with the schedule in the state
        dict's _metadata; the parent's load_state_dict() reads them back (see
        _state/ema_state.py)."""
        if args:  # nn.Module's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)[len(args) :])
        self._ready("state_dict")
        return self._state.state_dict(destination, prefix, keep_vars, self._version)

    def load_state_dict(
        self, state, strict: bool = True, assign: bool = False, *, step=None
    ) -> LoadResult:
        """Restores an EMA from `state` (or a file path): fused_ema's own state_dict, a model
        state dict, or a checkpoint of timm, AveragedModel, Lightning's EMAWeightAveraging,
        ema-pytorch, diffusers or torch_ema.

        Every key, shape, dtype, the step and the schedule are checked and the tensors moved to
        the EMA's devices before anything changes; all problems are reported in one
        CheckpointError and the EMA is left as it was. With strict=False what matches is loaded
        and the rest is reported in the returned LoadResult. `assign` (nn.Module's) is accepted
        and ignored: values are always copied into the EMA's own tensors.

        A path to a directory reads a diffusers ``save_pretrained`` folder. The EMA continues
        from `step` when given, else from the checkpoint's step, else (timm's checkpoints and
        plain state dicts store none) from update_after_step + 1: it has started, and the next
        update averages.
        """
        self._refuse_in_set("load_state_dict", "set")
        self._ready("load_state_dict")
        with self._updater.exclusive("ema.load_state_dict()"):
            return self._state.apply(*self._state.prepare(state, strict, step))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """A parent module's load_state_dict(): the EMA's keys under `prefix`, all or nothing."""
        self._refuse_in_set("load_state_dict", "set")
        self._ready("load_state_dict")
        with self._updater.exclusive("ema.load_state_dict()"):
            prepared = self._state.prepare_nested(
                state_dict, prefix, local_metadata, missing_keys, unexpected_keys, errors
            )
            if prepared is not None:
                self._state.apply(*prepared)

    # ------------------------------------------------------------------ diagnostics

    def stats(self, model: nn.Module | None = None) -> dict:
        """Health of the average (reads device tensors: not for the hot loop). For a sharded EMA
        the counts and distances cover this rank's shards.

        With `model`: the relative distance ||ema - model|| / ||model|| over averaged tensors, and
        the fraction of averaged elements that an update with the latest weight would leave
        unchanged because the change rounds away (near 1.0: the EMA has stopped moving), counted
        with round to nearest: stochastic rounding still moves some of them, by chance.
        """
        self._ready("stats")
        model = unwrap_model(model) if model is not None else None
        options = self._schedule.options
        every = options["update_every"] if options["update_every_decay"] == "compensated" else 1
        return ema_stats(
            self._binding.table.entries, self.step, self.current_decay, self.decay, model, every
        )

    def full_state_dict(self, rank: int | None = 0, cpu_offload: bool = True) -> dict:
        """Whole, plain EMA tensors by name (a model state dict: ``model.load_state_dict`` takes
        it), for export or evaluation. A sharded (DTensor) EMA is gathered, which is a collective:
        every rank must call this. With `rank`, only that rank keeps the result and the others get
        {}; rank=None keeps it everywhere. `cpu_offload` returns CPU tensors."""
        self._ready("full_state_dict")
        entries, replicated = self._binding.table.entries, self._binding.policy.shard is not None
        return gather_full(entries, rank, cpu_offload, replicated)

    # ------------------------------------------------------------------ copies and pickling

    def __getstate__(self) -> dict:
        self._updater.ready(error="a ModelEma cannot be copied or pickled inside ema.swapped()")
        transient = ("_updater", "_key", "_hooks")  # rebuilt by _init_transient
        return {k: v for k, v in self.__dict__.items() if k not in transient}

    def __copy__(self) -> ModelEma:
        # A shallow copy shared the tensors, step and ema.module, not the lock and swapped() flag
        # that guard them (its update inside the original's swapped() wrote into the model).
        return copy.deepcopy(self)

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)
        self._init_transient()
        self._binding.rehook(self)

    def __repr__(self) -> str:
        sc = self._schedule.options
        where = str(self.device) if self.device is not None else "with the model"
        return (
            f"ModelEma({len(self._binding.table.entries)} tensors, decay={sc['decay']}, "
            f"device={where}, buffers={self.buffer_mode!r}, warmup={sc['warmup']}, "
            f"update_after_step={sc['update_after_step']}, update_every={sc['update_every']})"
        )
