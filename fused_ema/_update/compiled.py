"""ModelEma.update inside torch.compile: the traced program walks the model (averaging toward what
the compiled code computed) and calls one opaque op that runs the eager update, structure checks
included, on the live model (prepared when handed the model's own tensors). The op mutates the
EMA's step counter, which keeps it in the graph and ordered."""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

_EMAS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register(ema) -> int:
    key = next(_KEYS)
    _EMAS[key] = ema
    return key


@torch.library.custom_op("fused_ema::model_ema_update", mutates_args=("step_state",))
def model_ema_update(
    step_state: torch.Tensor,
    values: list[Optional[torch.Tensor]],  # noqa: UP006, UP045 (the op schema needs these)
    step: Optional[torch.Tensor],  # noqa: UP045
    step_int: Optional[int],  # noqa: UP045
    key: int,
    refusal: Optional[str] = None,  # noqa: UP045
) -> None:
    ema = _EMAS.get(key)
    if ema is None:
        raise RuntimeError("fused_ema: a compiled program updates a ModelEma that no longer exists")
    if refusal is not None:  # a step eager update refuses (Updater.trace), after the same waits
        for track in (ema._updater, *ema._updater.followers):
            track.ready("update")
        raise ValueError(refusal)
    ema._updater.update_traced(ema, values, step if step is not None else step_int)
    if step_state is not ema._schedule.step:  # a functional copy: carry the new count back
        step_state.copy_(ema._schedule.step)


@model_ema_update.register_fake
def _model_ema_update_fake(step_state, values, step, step_int, key, refusal=None) -> None:
    return None
