"""What both framework callbacks share: the ModelEma keyword check at construction, and swapping
the EMA weights into a model across two framework hooks (enter in one, leave in another).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from ..ema import ModelEma


def check_ema_arguments(ema, decay, ema_kwargs: dict) -> dict:
    """Checks the ModelEma keywords now, with ModelEma's own messages, instead of at the first
    training step: a throwaway EMA of a one-parameter module (device left out: the callback is
    often built before the devices are set up, and a CUDA device must not be touched here)."""
    if ema is not None:
        if not isinstance(ema, ModelEma):
            raise TypeError(f"ema must be a fused_ema.ModelEma, got {type(ema).__name__}")
        if ema_kwargs or decay is not None:
            raise ValueError(
                "pass either a ModelEma (ema=) or its keywords (decay=, ...), not both"
            )
        return {}
    kwargs = dict(ema_kwargs)
    if decay is not None:
        kwargs["decay"] = decay
    probe = {key: value for key, value in kwargs.items() if key != "device"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ModelEma(nn.Linear(1, 1, bias=False, dtype=torch.float32), **probe)
    return kwargs


class HeldSwap:
    """`ema.swapped(model)` entered in one hook and left in another (validation start and end),
    left also when the framework reports an exception. `paused()` puts the training weights back
    for a moment (a checkpoint written while the EMA weights are in the model)."""

    def __init__(self):
        self._context = None
        self._target = None

    @property
    def active(self) -> bool:
        return self._context is not None

    def enter(self, ema: ModelEma, model: nn.Module) -> None:
        if self._context is not None:
            return  # already swapped in (validation nested in a test run, a hook called twice)
        context = ema.swapped(model)
        context.__enter__()
        self._context, self._target = context, (ema, model)

    def leave(self) -> None:
        context, self._context, self._target = self._context, None, None
        if context is not None:
            context.__exit__(None, None, None)

    @contextlib.contextmanager
    def paused(self):
        """Training weights in the model (and the EMA's own tensors holding the EMA) for the
        block; the EMA weights go back in after it. Yields whether a swap was paused."""
        if self._context is None:
            yield False
            return
        target = self._target
        self.leave()
        try:
            yield True
        finally:
            self.enter(*target)
