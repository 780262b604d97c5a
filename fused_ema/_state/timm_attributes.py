"""The attributes timm's ModelEmaV3 keeps for its constructor arguments (ema.decay, ema.min_decay,
ema.update_after_step, ema.use_warmup, ...), read from where ModelEma holds them; the schedule's
can be set, checked like the constructor's, and apply from the next update."""

from __future__ import annotations

from .._update.schedule import DEFAULT_WARMUP, check_options


def _option(key: str, doc: str) -> property:
    """A schedule option as a settable attribute, as on timm."""

    def set_option(self, value) -> None:
        self._ready(f"{key} setter")
        self._schedule.load(check_options(**{**self._schedule.options, key: value}), None)

    return property(lambda self: self._schedule.options[key], set_option, doc=f"{doc} Settable.")


def _warmup_pair(self) -> tuple[float, float] | None:
    """The warmup when it is timm's (gamma, power) ramp, else None."""
    warmup = self._schedule.options["warmup"]
    plain = isinstance(warmup, tuple) and len(warmup) == 2 and isinstance(warmup[0], float)
    return warmup if plain else None


class TimmAttributes:
    """Mixed into ModelEma: needs its _schedule, _binding, _state and _ready()."""

    decay = _option("decay", "The configured per-step decay (the warmup ramps up to it).")
    min_decay = _option("min_decay", "The warmup's lower bound of the decay.")
    update_after_step = _option(
        "update_after_step", "Steps up to update_after_step + 1 copy the model."
    )
    use_warmup = property(
        lambda self: _warmup_pair(self) is not None,
        doc="Whether the warmup is timm's (gamma, power) ramp (the other ramps read False).",
    )
    warmup_gamma = property(
        lambda self: (_warmup_pair(self) or DEFAULT_WARMUP)[0],
        doc="The (gamma, power) ramp's gamma; timm's default 1.0 under another warmup or none.",
    )
    warmup_power = property(
        lambda self: (_warmup_pair(self) or DEFAULT_WARMUP)[1],
        doc="The (gamma, power) ramp's power; timm's default 2/3 under another warmup or none.",
    )
    exclude_buffers = property(
        lambda self: self._binding.policy.buffers == "copy",
        doc='timm\'s spelling of buffers="copy".',
    )
    foreach = property(
        lambda self: True,
        doc="Always True: every update is one fused multi-tensor call per device.",
    )
    dtype = property(
        lambda self: self._binding.policy.dtype,
        doc="The dtype= the EMA was built with (None: float32, float64 for float64 weights).",
    )
    stochastic_rounding = property(
        lambda self: self._state.rounding["stochastic_rounding"],
        doc="Whether bfloat16/float16 EMA tensors are rounded stochastically.",
    )
    stochastic_rounding_seed = property(
        lambda self: self._state.rounding["stochastic_rounding_seed"],
        doc="The seed of the stochastic rounding's random bits.",
    )
