"""Bema: BEMA, the bias-corrected EMA (Block & Zhang 2025), with TRL's BEMACallback's arguments and
meaning. Three ModelEmas of the model (the EMA, theta0 and the corrected weights) updated together
by one fused pass (ops.bema_), so every ModelEma promise (devices, dtypes, buffers, names,
checkpoints, structure changes, non_blocking, compile, DDP) holds for each."""

from __future__ import annotations

import contextlib

from torch import nn

from ._model.walk import unwrap_model
from ._tracks import TrackSet, same
from ._update.schedule import BEMA, check_bema, whole_number
from .ema import ModelEma

__all__ = ["Bema"]

# The arguments that define the schedule, in TRL's order (a checkpoint's must match).
OPTIONS = (
    "update_freq",
    "ema_power",
    "bias_power",
    "lag",
    "update_after",
    "multiplier",
    "min_ema_multiplier",
)


class Bema(TrackSet):
    """BEMA of `model`: ``theta'_t = alpha_t * (theta_t - theta_0) + EMA_t`` (Block and Zhang,
    "EMA Without the Lag", 2025), as TRL's ``BEMACallback`` computes it.

    ``EMA_t = (1 - beta_t) * EMA_{t-1} + beta_t * theta_t`` with
    ``beta_t = max((lag + multiplier * t) ** -ema_power, min_ema_multiplier)`` and
    ``alpha_t = (lag + multiplier * t) ** -bias_power``, where t is the training step (TRL's
    ``state.global_step``: counted from the start of training, not from ``update_after``). At step
    ``update_after`` theta_0 and the EMA become the model; after it, every ``update_freq`` steps,
    the EMA moves and the corrected weights theta' are formed, in one pass over the model's
    tensors. Before the first such step the corrected weights are the model as it was when the
    Bema was built (as TRL's running model is).

    ``update(model)`` counts steps 1, 2, ...; ``update(model, step=state.global_step)`` uses the
    trainer's. ``module``, ``swapped(model)``, ``copy_to(model)`` and ``bema(x)`` give the
    corrected weights; ``ema``, ``theta0`` and ``corrected`` are the three ModelEmas.

    Args:
        model: the module to follow.
        update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier:
            TRL's BEMACallback arguments (phi, kappa, eta, rho, tau, gamma and beta's floor).
        device, dtype, buffers, on_mismatch, copy_names, ignore_names, shard: as ModelEma. The
            EMA, theta_0 and the corrected weights share the dtype (None: float32 for 16/32-bit
            weights); 16-bit ones round to nearest. Averaged float buffers get BEMA like
            parameters; integer buffers are copied.
    """

    FORMAT = "fused_ema.bema"
    JOINT = "bema"

    def __init__(
        self,
        model: nn.Module,
        *,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: float = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device=None,
        dtype=None,
        buffers: str = "average",
        on_mismatch: str = "error",
        copy_names=None,
        ignore_names=None,
        shard=False,
    ):
        super().__init__()
        self.options = o = check_bema_options(
            update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier
        )
        vars(self).update(o)  # TRL's attribute names: bema.update_freq...
        model = unwrap_model(model)
        tracks = tuple(
            ModelEma(
                model,
                decay=1.0,
                min_decay=o["min_ema_multiplier"],
                update_after_step=o["update_after"],
                update_every=o["update_freq"],
                warmup=(BEMA, part, o["lag"], o["multiplier"], o["ema_power"], o["bias_power"]),
                device=device,
                dtype=dtype,
                stochastic_rounding=False,
                buffers=buffers,
                on_mismatch=on_mismatch,
                copy_names=copy_names,
                ignore_names=ignore_names,
                shard=shard,
            )
            for part in ("ema", "theta0", "alpha")
        )
        self._start(tracks, ("ema", "theta0", "corrected"))

    # ------------------------------------------------------------------ the parts

    @property
    def ema(self) -> ModelEma:
        """EMA_t, the moving average that BEMA corrects."""
        return self._tracks[0]

    @property
    def theta0(self) -> ModelEma:
        """theta_0: the model at step update_after (at construction until then)."""
        return self._tracks[1]

    @property
    def corrected(self) -> ModelEma:
        """The corrected weights theta'_t of the latest BEMA step."""
        return self._tracks[2]

    @property
    def module(self) -> nn.Module:
        """A module holding the corrected weights (TRL's running model), for evaluation."""
        return self.corrected.module

    @property
    def running_model(self) -> nn.Module:
        """TRL's name for `module`."""
        return self.module

    def factors(self, step: int) -> tuple[float, float]:
        """(beta_t, alpha_t) of training step `step`, as TRL computes them."""
        step = whole_number("step", step, 1)
        o = self.options
        base = o["lag"] + o["multiplier"] * step
        beta = max(base ** -o["ema_power"], o["min_ema_multiplier"])
        return beta, base ** -o["bias_power"]

    # ------------------------------------------------------------------ using it

    def update(self, model: nn.Module, step=None, non_blocking: bool = False) -> None:
        """One training step: at step update_after, theta_0 and the EMA become the model; on each
        BEMA step after it, the EMA moves and the corrected weights are formed, reading every
        model tensor once. Other steps only count."""
        self._tracks[0]._update(model, step, non_blocking)  # (update() refuses a track's)

    def forward(self, *args, **kwargs):
        return self.corrected(*args, **kwargs)

    def swapped(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """``with bema.swapped(model):`` the corrected weights in `model` for the block."""
        return self.corrected.swapped(model)

    def copy_to(self, model: nn.Module) -> None:
        """Writes the corrected weights into `model`."""
        self.corrected.copy_to(model)

    # ------------------------------------------------------------------ checkpoints

    def _header(self) -> dict:
        return {"options": dict(self.options), "step": self.step}

    def _header_problems(self, state: dict) -> list[str]:
        saved = state.get("options")
        if not isinstance(saved, dict) or set(saved) != set(OPTIONS):
            return [f"options {saved!r}: expected a dict of {list(OPTIONS)}"]
        return [
            f"{name} {saved[name]!r} in the checkpoint: this Bema has {value!r}"
            for name, value in self.options.items()
            if not same(saved[name], value)
        ]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"Bema({args})"


def check_bema_options(
    update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier
) -> dict:
    """TRL's arguments, validated: each refused with its own name."""
    update_freq = whole_number("update_freq", update_freq, 1)
    update_after = whole_number("update_after", update_after, 0)
    floor = min_ema_multiplier
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= 1.0:
        raise ValueError(f"min_ema_multiplier must be a number in [0, 1], got {floor!r}")
    _, _, lag, multiplier, ema_power, bias_power = check_bema(
        (BEMA, "ema", lag, multiplier, ema_power, bias_power)
    )
    values = (update_freq, ema_power, bias_power, lag, update_after, multiplier, float(floor))
    return dict(zip(OPTIONS, values))  # in OPTIONS' order
