"""The EMA's decay schedule and step counter. Options are checked once; the step, the weight of
the current step and the options live in tensors where the EMA lives (csrc/schedule*), so an
update reads nothing back to the host. A step can be begun and rolled back; once a CUDA graph has
captured them, the tensors stay where they are."""

from __future__ import annotations

import math
import operator

import torch

from .._ext.grad import outside_inference_mode, without_grad
from .._ext.loader import _C
from .._model.swap import finish_all
from ..ops import storage_shortfall

#: Steps beyond this cannot be counted exactly in the float64 schedule arithmetic.
MAX_STEP = int(_C.MAX_STEP)
DEFAULT_WARMUP = (1.0, 2.0 / 3.0)  # timm's and ema-pytorch's (gamma, power)
OPTION_KEYS = (
    "decay",
    "min_decay",
    "warmup",
    "update_after_step",
    "update_every",
    "update_every_decay",
)
# The (1 + s) / (10 + s) ramps, by the peer that counts s that way (csrc/schedule_formula.h).
RAMP_WARMUPS = {"diffusers": 2, "torch_ema": 3}
# EDM2's power-function EMA, ("power_function", gamma): decay (1 - 1/t) ** (gamma + 1) at the
# t-th averaging update (fused_ema.PostHocEma's tracks).
POWER_FUNCTION = "power_function"
POWER_FUNCTION_KIND = 4
EVERY_DECAYS = ("compensated", "plain")
# fused_ema.Bema's tracks, ("bema", part, lag, multiplier, ema_power, bias_power): part "ema",
# "theta0" or "alpha" (csrc/schedule_formula.h's bema_weight).
BEMA = "bema"
BEMA_KINDS = {"ema": 5, "theta0": 6, "alpha": 7}
BEMA_FIELDS = ("lag", "multiplier", "ema_power", "bias_power")


def check_bema(warmup) -> tuple:
    """A Bema track's warmup, validated: ("bema", part, lag, multiplier, ema_power, bias_power)."""
    part, *values = warmup[1:]
    if part not in BEMA_KINDS:
        raise ValueError(f"a BEMA track is one of {tuple(BEMA_KINDS)}, got {part!r}")
    checked = []
    for name, value in zip(BEMA_FIELDS, values):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        checked.append(float(value))
    if checked[0] + checked[1] <= 0:
        raise ValueError(
            f"lag + multiplier must be > 0 (BEMA's lag + multiplier * t for t >= 1), got lag "
            f"{values[0]!r} and multiplier {values[1]!r}"
        )
    return (BEMA, part, *checked)


def _real(name: str, value, low: float, high: float) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and low <= float(value) <= high):  # also refuses NaN
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def whole_number(name: str, value, low: int, high: int = MAX_STEP) -> int:
    """An int (or numpy integer) in [low, high]; refuses bool, float, NaN and other types."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", 0) == 0:
        value = value.item()  # a numpy scalar or 0-d array: its Python number, checked below
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError(f"{name} must be a whole number in [{low}, {high}], got {value!r}")
    # Asked, not tried: torch.compile traces this (a compiled update's step), and dynamo fails
    # on a TypeError raised inside operator.index on some torch versions.
    if not hasattr(type(value), "__index__") or type(value).__module__ == "numpy":
        raise ValueError(
            f"{name} must be a whole number in [{low}, {high}], got {type(value).__name__} "
            f"{value!r}"
        )
    number = operator.index(value)
    if not low <= number <= high:
        raise ValueError(f"{name} must be a whole number in [{low}, {high}], got {number}")
    return number


def check_options(
    decay,
    min_decay=0.0,
    warmup=False,
    update_after_step=0,
    update_every=1,
    update_every_decay="compensated",
):
    """The schedule options, validated and normalised (warmup: None, (gamma, power), "diffusers",
    "torch_ema" or ("power_function", gamma))."""
    decay = _real("decay", decay, 0.0, 1.0)
    min_decay = _real("min_decay (at most decay)", min_decay, 0.0, decay)
    if warmup is True:
        warmup = DEFAULT_WARMUP
    wrong = (
        "warmup must be False, True, (gamma, power), 'diffusers', 'torch_ema' or "
        f"('power_function', gamma), got {warmup!r}"
    )
    if isinstance(warmup, (tuple, list)) and len(warmup) == 6 and warmup[0] == BEMA:
        warmup = check_bema(warmup)
    elif isinstance(warmup, (tuple, list)) and len(warmup) == 2 and warmup[0] == POWER_FUNCTION:
        gamma = warmup[1]
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > -1:
            raise ValueError(f"the power function's gamma must be a number > -1, got {gamma!r}")
        if not math.isfinite(gamma):
            raise ValueError(f"the power function's gamma must be finite, got {gamma!r}")
        warmup = (POWER_FUNCTION, float(gamma))
    elif warmup is False or warmup is None:
        warmup = None
    elif isinstance(warmup, str):
        if warmup not in RAMP_WARMUPS:
            raise ValueError(wrong)
    else:
        # Numbers only: float() would also take "2", True, a tensor or the keys of a dict.
        if not (isinstance(warmup, (tuple, list)) and len(warmup) == 2):
            raise ValueError(wrong)
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in warmup):
            raise ValueError(f"warmup gamma and power must be numbers, got {warmup!r}")
        gamma, power = (float(v) for v in warmup)
        if not (0 < gamma < math.inf and 0 < power < math.inf):
            raise ValueError(f"warmup gamma and power must be positive and finite, got {warmup!r}")
        warmup = (gamma, power)
    if update_every_decay not in EVERY_DECAYS:
        raise ValueError(
            f"update_every_decay must be one of {EVERY_DECAYS}, got {update_every_decay!r}"
        )
    return {
        "decay": decay,
        "min_decay": min_decay,
        "warmup": warmup,
        "update_after_step": whole_number("update_after_step", update_after_step, 0),
        "update_every": whole_number("update_every", update_every, 1),
        "update_every_decay": update_every_decay,
    }


def check_rounding(stochastic_rounding, seed) -> dict:
    """The stochastic-rounding options: a bool and a seed that fits in 64 bits."""
    if not isinstance(stochastic_rounding, bool):
        raise ValueError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")
    seed = whole_number("stochastic_rounding_seed", seed, -(2**63), 2**64 - 1)
    return {"stochastic_rounding": stochastic_rounding, "stochastic_rounding_seed": seed}


def rounding_from_state(rounding) -> dict:
    keys = {"stochastic_rounding", "stochastic_rounding_seed"}
    if not isinstance(rounding, dict) or set(rounding) != keys:
        raise ValueError(
            f"expected stochastic_rounding and stochastic_rounding_seed, got {rounding!r}"
        )
    return check_rounding(rounding["stochastic_rounding"], rounding["stochastic_rounding_seed"])


def options_from_state(schedule) -> dict:
    """check_options for a schedule read from a checkpoint (a dict of OPTION_KEYS)."""
    if not isinstance(schedule, dict):
        raise ValueError(f"expected a dict, got {type(schedule).__name__}")
    unknown = sorted(map(str, set(schedule) - set(OPTION_KEYS)))
    if unknown:
        raise ValueError(f"unknown schedule keys {unknown}")
    if "decay" not in schedule:
        raise ValueError("'decay' is missing")
    return check_options(**{k: schedule[k] for k in OPTION_KEYS if k in schedule})


def _config(options: dict, device) -> torch.Tensor:
    """The options as the schedule op's float64 config tensor on `device`."""
    warmup = options["warmup"]
    gamma, power, kind = 0.0, 1.0, 0.0
    bema = [0.0] * len(BEMA_FIELDS)
    if isinstance(warmup, str):
        kind = float(RAMP_WARMUPS[warmup])
    elif warmup is not None and warmup[0] == POWER_FUNCTION:
        gamma, kind = warmup[1], float(POWER_FUNCTION_KIND)
    elif warmup is not None and warmup[0] == BEMA:
        kind, bema = float(BEMA_KINDS[warmup[1]]), list(warmup[2:])
    elif warmup is not None:
        (gamma, power), kind = warmup, 1.0
    values = [
        options["decay"],
        options["min_decay"],
        gamma,
        power,
        float(options["update_after_step"]),
        float(options["update_every"]),
        kind,
        float(EVERY_DECAYS.index(options["update_every_decay"])),
        *bema,
    ]
    return torch.tensor(values, dtype=torch.float64).to(device)


class Schedule:
    """The step counter and the weight of its step, in tensors on one device.

    `begin(step)` moves the counter for an update (validating `step` first), `rollback()` undoes
    the latest begin if the update it belongs to did nothing, `commit()` makes it final."""

    @outside_inference_mode  # the counter is written outside the mode too
    def __init__(self, options: dict, device: torch.device):
        self.options = options
        self.captured = False  # a CUDA graph holds pointers to these tensors
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self._saved = torch.zeros_like(self.step)
        self.out = torch.zeros(2, dtype=torch.float64, device=device)  # (weight, decay)
        # The current step's weight, what the fused kernel reads (no host sync): a view of out,
        # made again wherever out is replaced (place, a copy or unpickling).
        self.weight = self.out[:1]
        self.config = _config(options, device)
        without_grad(self._compute, False)
        self._dirty = False
        self.rollbacks = 0  # updates undone so far: a count cached elsewhere is stale after one

    def _compute(self, advance: bool) -> None:
        torch.ops.fused_ema.ema_schedule_(self.step, self.out, self.config, advance)

    # ------------------------------------------------------------------ one update

    def check_step(self, step) -> int | torch.Tensor | None:
        """Validates an update's `step` before anything changes."""
        if step is None:
            return None
        if isinstance(step, torch.Tensor):
            if step.layout != torch.strided:  # reshape and the C++ read refuse sparse tensors
                raise ValueError(f"step must be a dense integer tensor, got layout {step.layout}")
            if step.numel() != 1:
                raise ValueError(
                    f"step must be one number, got a tensor of shape {list(step.shape)}"
                )
            if step.dtype == torch.bool or step.is_floating_point() or step.is_complex():
                raise ValueError(f"step must be an integer tensor, got {step.dtype}")
            if step.is_meta:
                raise ValueError("step is a meta tensor, which holds no value")
            if storage_shortfall(step) is not None:  # reading it would crash the process
                raise ValueError("step is a tensor whose memory was freed (resize_(0)?)")
            if step.device.type == "cpu":
                # Read in C++, not in Python: no host sync and nothing Python-visible to count.
                value = step.reshape(()).to(torch.int64)
                ok = (value >= 0) & (value <= MAX_STEP)
                try:
                    torch._assert_async(ok)
                except RuntimeError:
                    raise ValueError(
                        f"step must be a whole number in [0, {MAX_STEP}], got {int(step)}"
                    ) from None
            return step
        return whole_number("step", step, 0)

    def as_value(self, step) -> int:
        """A step to set (ema.step = ..., load_state_dict(step=)) as an int, checked like an
        update's step."""
        if isinstance(step, torch.Tensor):
            self.check_step(step)
            step = int(step.reshape(()).item())
        return whole_number("step", step, 0)

    def begin(self, step) -> None:
        """Sets (`step` given) or advances the counter and computes this step's weight. A device
        step tensor out of [0, MAX_STEP] cannot be refused without a sync: it makes the update
        a no-op (weight 0)."""
        # Saved, marked, then moved: an interrupt between any two leaves rollback() right.
        self._saved.copy_(self.step)
        self._dirty = True
        if step is None:
            self._compute(advance=True)
            return
        if not isinstance(step, torch.Tensor):
            self.step.fill_(step)
        elif step.is_cpu and not self.step.is_cpu:
            self.step.fill_(step.reshape(()).item())  # a CPU value for a device counter: no sync
        else:
            self.step.copy_(step.reshape(()))
        self._compute(advance=False)

    def commit(self) -> None:
        self._dirty = False

    def rollback(self) -> None:
        """Undoes the latest begin()."""
        if self._dirty:
            self.step.copy_(self._saved)
            self._compute(advance=False)
            self._dirty = False
            self.rollbacks = getattr(self, "rollbacks", 0) + 1

    def note_capture(self) -> None:
        if self.step.is_cuda and torch.cuda.is_current_stream_capturing():
            self.captured = True

    # ------------------------------------------------------------------ placement and state

    def place(self, device: torch.device) -> None:
        """Moves the tensors to `device` (where the EMA's first non-CPU tensor lives)."""
        self.__dict__.update(self.placed(device))

    def placed(self, device: torch.device) -> dict:
        """The tensors place(device) sets, made aside (attribute: tensor), to be set at once."""
        if self.step.device == device:
            return {}
        if self.captured:
            raise RuntimeError(
                f"fused_ema: the EMA's step counter was captured in a CUDA graph on "
                f"{self.step.device}; moving it to {device} would leave the graph reading freed "
                "memory. Keep the EMA on the device it was captured on, or build a new EMA."
            )
        step, out = self.step.to(device), self.out.to(device)
        config, saved = self.config.to(device), torch.zeros_like(step)
        return {"step": step, "out": out, "weight": out[:1], "_saved": saved, "config": config}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.weight = self.out[:1]  # a view of this copy's out, whatever the copy made of it

    def value(self) -> int:
        return int(self.step.item())

    def decay_at(self, step) -> float:
        """The per-step decay of `step` by the formula the update runs, computed on the host
        (the counter is left as it is)."""
        step = self.check_step(step)
        step = torch.as_tensor(step).detach().to("cpu", torch.int64).reshape(())
        out = torch.zeros(2, dtype=torch.float64)
        torch.ops.fused_ema.ema_schedule_(step.clone(), out, self.config.to("cpu"), False)
        return float(out[1])

    def current_decay(self) -> float:
        return float(self.out[1].item())

    def load(self, options: dict | None, step: int | None) -> None:
        """Applies already validated options and step: the tensors by one copy call, then the
        options (an interrupt between the two lets the second happen before it propagates)."""
        pairs = self.loaded(options, step)
        copy = [t for _, _, t in pairs], [v for _, v, _ in pairs]
        steps = [lambda: without_grad(torch._foreach_copy_, *copy)]
        if options is not None:
            steps.append(lambda: setattr(self, "options", options))
        finish_all(steps)

    def loaded(self, options: dict | None, step: int | None) -> list:
        """What a load writes into these tensors, computed aside, as (name, value, target): the
        config of `options` (None: kept), the counter at `step` (None: kept) and that step's
        weight and decay."""
        config = self.config if options is None else _config(options, self.config.device)
        counter = self.step.clone() if step is None else torch.full_like(self.step, step)
        out = torch.empty_like(self.out)
        without_grad(torch.ops.fused_ema.ema_schedule_, counter, out, config, False)
        return [
            ("config", config, self.config),
            ("step", counter, self.step),
            ("out", out, self.out),
        ]
