"""ModelEma's checkpoints and the stochastic-rounding setting they carry: state_dict() (its own,
or flat keys in a parent module's, the settings in its _metadata: docs/checkpoints.md),
load_state_dict() (any format checkpoint.py reads, a file, a parent's state dict) and the warning
when that setting loses updates. A load is checked and converted whole before its first write, so
a failed one changes nothing."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Mapping

import torch

from .._dist import zero3
from .._files import read_source
from .._model.swap import check_resharding, copy_all, finish_all, unaliased
from .._model.walk import PARAM, named_tensors
from .._update.schedule import BEMA, POWER_FUNCTION, rounding_from_state
from ..checkpoint import FORMAT, FORMAT_VERSION, is_value, own_state
from ..errors import CheckpointError, PrecisionWarning
from .loading import LoadResult, filter_problems, prepare_load
from .options import BUFFER_MODES

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Inside a parent's state dict: {prefix}weights.{name}, {prefix}step, and these settings in its
# _metadata[prefix] under "fused_ema".
WEIGHTS, STEP, META_KEY = "weights.", "step", "fused_ema"
_NESTED_SETTINGS = ("format", "format_version", "schedule", "rounding", "buffers", "filters")
# Saved only by an EMA of ZeRO-3 partitions: the rank and world size they belong to.
PARTITION = "zero3_partition"


def rounding_seed(rounding: dict):
    """The seed of stochastic rounding, or None when 16-bit EMA tensors round to nearest."""
    return rounding["stochastic_rounding_seed"] if rounding["stochastic_rounding"] else None


def commit_loads(writes) -> None:
    """Writes the loads of one or more EMAs (EmaState.load_writes each): every tensor by one copy
    call (swap.copy_all), then the settings. Once it has begun, an interrupt stops none of it;
    a copy that fails (not interrupted) leaves the settings as they were."""
    pairs = unaliased([pair for tensors, _ in writes for pair in tensors])
    check_resharding(pairs)  # the last check: it raises before anything is written
    copied = []

    def copy() -> None:
        copy_all(pairs)
        copied.append(True)  # (an interrupt before this line runs the copy again)

    def once_copied(step):
        # finish_all runs every step even after one fails: the settings must not describe
        # tensors that were not written (new decay options beside the old config tensor).
        return lambda: step() if copied else None

    finish_all([copy, *(once_copied(step) for _, after in writes for step in after)])


class EmaState:
    """What a checkpoint holds of an EMA (the binding's tensors and filters, the schedule's step
    and options, and the rounding setting, owned here), saved and restored."""

    def __init__(self, binding, schedule, rounding: dict):
        self.binding = binding
        self.schedule = schedule
        self.rounding = rounding

    # ------------------------------------------------------------------ saving

    def state_dict(self, destination, prefix: str, keep_vars: bool, version):
        """ModelEma.state_dict(): its own dict, or (a parent module's state_dict()) flat keys in
        `destination` under `prefix`."""
        entries = self.binding.table.entries
        own = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "weights": {name: e.ema.detach() for e in entries for name in e.names},
            "step": self.schedule.step.detach(),
            "schedule": dict(self.schedule.options),
            "rounding": dict(self.rounding),
            "buffers": self.binding.policy.buffers,
            "filters": self.binding.policy.filters(),
        }
        holder = zero3.holder(entries)
        if holder is not None:
            own[PARTITION] = holder
        if destination is None and not prefix:
            return own
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()
        for e in entries:
            for name in e.names:
                destination[prefix + WEIGHTS + name] = e.ema if keep_vars else e.ema.detach()
        destination[prefix + STEP] = own["step"]
        if getattr(destination, "_metadata", None) is not None:
            settings = {k: own[k] for k in (*_NESTED_SETTINGS, PARTITION) if k in own}
            destination._metadata[prefix[:-1]] = {"version": version, META_KEY: settings}
        return destination

    # ------------------------------------------------------------------ loading

    def prepare(self, state, strict: bool, step=None, source: str = "checkpoint"):
        """Everything load_state_dict checks, reads and converts, before any write: `state` may
        be a file path; `step` overrides the checkpoint's. Returns (prepared, rounding)."""
        step = None if step is None else self.schedule.as_value(step)
        state, source = read_source(state, source)
        state = own_state(state)
        rounding, problems = None, []
        own = isinstance(state, Mapping) and is_value(state.get("format"), FORMAT)
        if own and "rounding" in state:
            try:
                rounding = rounding_from_state(state["rounding"])
            except (TypeError, ValueError) as err:
                problems.append(f"rounding: {err}")
        if own and not any(is_value(state.get("buffers", "average"), b) for b in BUFFER_MODES):
            problems.append(f"buffers must be one of {BUFFER_MODES}, got {state['buffers']!r}")
        binding = self.binding
        model, param_names = binding.model_ref(), None
        if model is not None and binding.policy.ignore:  # its positions count the ignored ones
            param_names = [t.name for t in named_tensors(model, False) if t.kind == PARAM]
        try:
            prepared = prepare_load(
                binding.table,
                state,
                strict,
                source,
                binding.policy,
                step,
                self.schedule.options,
                param_names,
            )
        except CheckpointError as err:  # with the rounding's problem: every problem in one error
            raise CheckpointError(err.problems + problems, source) from err
        if problems:
            raise CheckpointError(problems, source)
        if not prepared.values and binding.table.entries:
            rounding = None  # nothing loads (strict=False): the EMA keeps its settings
        return prepared, rounding

    def apply(self, prepared, rounding) -> LoadResult:
        """Writes what prepare() made; nothing here can fail on the checkpoint's data."""
        self.warn_precision(prepared.options, rounding)
        commit_loads([self.load_writes(prepared, rounding)])
        return prepared.result

    def load_writes(self, prepared, rounding) -> tuple[list, list]:
        """A load's writes, for commit_loads: (name, value, target) of every tensor (the weights,
        then the schedule's config, counter and weight, computed aside) and the Python settings
        to apply after them."""
        pairs = [(entry.name, value, entry.ema) for entry, value in prepared.values]
        pairs += self.schedule.loaded(prepared.options, prepared.step)
        after = []
        if prepared.options is not None:
            after.append(lambda: setattr(self.schedule, "options", prepared.options))
        if rounding is not None:
            after.append(lambda: setattr(self, "rounding", rounding))
            after.append(lambda: self.binding.set_seed(rounding_seed(rounding)))
        return pairs, after

    def prepare_nested(self, state_dict, prefix, metadata, missing_keys, unexpected_keys, errors):
        """A parent module's load_state_dict(): fused_ema's own state dict rebuilt from the keys
        under `prefix` and the settings in `metadata`, checked and converted as prepare() does;
        problems go to the parent's lists (it raises for them, or returns them if not strict).
        Returns what apply() takes, or None when anything was found: all or nothing. torch does
        not tell a submodule whether the parent's load is strict, so keys it does not know (or
        a missing step) also keep the EMA as it was, with a warning saying so."""
        own = {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": {}, "step": None}
        unexpected = []
        for key, value in state_dict.items():
            if key.startswith(prefix + WEIGHTS):
                own["weights"][key[len(prefix + WEIGHTS) :]] = value
            elif key == prefix + STEP:
                own["step"] = value
            elif key.startswith(prefix):
                unexpected.append(key)
        missing = [prefix + STEP] if own["step"] is None else []
        settings = (metadata or {}).get(META_KEY)
        if isinstance(settings, dict):
            own |= {
                k: settings[k]
                for k in ("format_version", "schedule", "rounding", "filters", PARTITION)
                if k in settings
            }
        elif settings is not None:
            own["format_version"] = settings  # reported by the parser as a format problem
        missing_keys.extend(missing)
        unexpected_keys.extend(unexpected)
        try:
            # A missing step refuses the load below; 0 stands in so that prepare() does not warn
            # of the step a load without one would take.
            stand_in = 0 if own["step"] is None else None
            prepared = self.prepare(own, False, stand_in, source=prefix[:-1] or "the state dict")
        except CheckpointError as err:
            errors.extend(f"{prefix[:-1] or 'ModelEma'}: {p}" for p in err.problems)
            return None
        # What a strict flat load refuses (the parent raises for its errors whatever its strict,
        # so no strict=False remedy is offered).
        filters = filter_problems(own.get("filters"), self.binding.policy, remedy="")
        errors.extend(f"{prefix[:-1] or 'ModelEma'}: {p}" for p in filters)
        result, weights = prepared[0].result, prefix + WEIGHTS
        missing_keys.extend(weights + k for k in result.missing_keys)
        unexpected_keys.extend(weights + k for k in result.unexpected_keys)
        errors.extend(weights + problem for problem in prepared[0].problems)
        keys = [*missing, *unexpected, *(weights + k for k in result.missing_keys)]
        keys += [weights + k for k in result.unexpected_keys]
        if result.mismatched_keys or filters:
            return None
        if keys:
            warnings.warn(
                f"fused_ema: {prefix[:-1] or 'the EMA'} was not loaded: the state dict's keys "
                f"under it do not match it ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"
                "), and torch does not tell the EMA whether the load is strict. Load it with "
                "ema.load_state_dict(..., strict=False) to take what matches",
                UserWarning,
                stacklevel=4,
            )
            return None
        return prepared

    # ------------------------------------------------------------------ the rounding setting

    def warn_precision(self, options=None, rounding=None, dtype=None) -> None:
        """A PrecisionWarning when 16-bit averaged tensors, a high decay and round-to-nearest
        would lose most updates (raised at the caller of the ModelEma method that called this).
        Called before a change with what it will give (its schedule options, rounding, dtype), so
        that a warning raised as an error (-W error) changes nothing."""
        options = options or self.schedule.options
        warmup, decay = options["warmup"], options["decay"]
        if isinstance(warmup, (tuple, list)) and warmup and warmup[0] in (BEMA, POWER_FUNCTION):
            return  # Bema's and PostHocEma's tracks: their decay= is not the one they apply
        averaged = [e.ema.dtype for e in self.binding.table.entries if e.average]
        low = {str(dtype or d) for d in averaged if (dtype or d) in _LOW_PRECISION}
        if low and decay > 0.99 and not (rounding or self.rounding)["stochastic_rounding"]:
            warnings.warn(
                f"fused_ema: a {', '.join(sorted(low))} EMA with decay {decay} loses most "
                f"updates to rounding: a step moves a weight by {1 - decay:.0e} of its "
                "distance to the model, below half an ulp of a 16-bit float for most entries, so "
                "they stop moving. Keep stochastic_rounding=True (the default), keep the EMA in "
                "float32 (dtype=None does that even for a 16-bit model) or lower the decay.",
                PrecisionWarning,
                stacklevel=3,
            )
