"""The attributes timm's ModelEmaV3 keeps for its constructor arguments (ema.decay, ema.min_decay,
ema.update_after_step, ema.use_warmup, ...), read from where ModelEma holds them. decay, min_decay,
update_after_step and update_every can be set, checked like the constructor's, and apply from the
next update; the others are read-only (the warmup is chosen when the EMA is built)."""

from __future__ import annotations

import torch

from .._update.schedule import DEFAULT_WARMUP, check_options


class TimmAttributes:
    """Mixed into ModelEma: needs its _schedule, _binding, _state and _ready()."""

    def _set_option(self, key: str, value) -> None:
        self._ready(f"{key} setter")
        options = check_options(**{**self._schedule.options, key: value})
        self._state.warn_precision(options)  # (before: raised as an error, it changes nothing)
        self._schedule.load(options, None)

    @property
    def decay(self) -> float:
        """The configured per-step decay (the warmup ramps up to it). Settable, as on timm."""
        return self._schedule.options["decay"]

    @decay.setter
    def decay(self, value) -> None:
        self._set_option("decay", value)

    @property
    def min_decay(self) -> float:
        """The warmup's lower bound of the decay. Settable, as on timm."""
        return self._schedule.options["min_decay"]

    @min_decay.setter
    def min_decay(self, value) -> None:
        self._set_option("min_decay", value)

    @property
    def update_after_step(self) -> int:
        """Steps up to update_after_step + 1 copy the model. Settable, as on timm."""
        return self._schedule.options["update_after_step"]

    @update_after_step.setter
    def update_after_step(self, value) -> None:
        self._set_option("update_after_step", value)

    @property
    def update_every(self) -> int:
        """Updates apply on every k-th step (see ModelEma's update_every). Settable, as decay is."""
        return self._schedule.options["update_every"]

    @update_every.setter
    def update_every(self, value) -> None:
        self._set_option("update_every", value)

    @property
    def use_warmup(self) -> bool:
        """Whether the warmup is timm's (gamma, power) ramp (the other ramps read False)."""
        return isinstance(self._warmup_pair(), tuple)

    @property
    def warmup_gamma(self) -> float:
        """The (gamma, power) ramp's gamma; timm's default 1.0 under another warmup or none."""
        return (self._warmup_pair() or DEFAULT_WARMUP)[0]

    @property
    def warmup_power(self) -> float:
        """The (gamma, power) ramp's power; timm's default 2/3 under another warmup or none."""
        return (self._warmup_pair() or DEFAULT_WARMUP)[1]

    def _warmup_pair(self) -> tuple[float, float] | None:
        warmup = self._schedule.options["warmup"]
        plain = isinstance(warmup, tuple) and len(warmup) == 2 and isinstance(warmup[0], float)
        return warmup if plain else None

    @property
    def exclude_buffers(self) -> bool:
        """timm's spelling of buffers="copy"."""
        return self._binding.policy.buffers == "copy"

    @property
    def foreach(self) -> bool:
        """Always True: every update is one fused multi-tensor call per device."""
        return True

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype= the EMA was built with (None: float32, float64 for float64 weights)."""
        return self._binding.policy.dtype

    @property
    def stochastic_rounding(self) -> bool:
        """Whether bfloat16/float16 EMA tensors are rounded stochastically."""
        return self._state.rounding["stochastic_rounding"]

    @property
    def stochastic_rounding_seed(self) -> int:
        """The seed of the stochastic rounding's random bits."""
        return self._state.rounding["stochastic_rounding_seed"]
