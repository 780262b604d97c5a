"""What the framework integrations share: the callbacks' argument checks at construction, an EMA
swapped into the model across hooks, and an EMA's state dict with DeepSpeed ZeRO-3 partitions
gathered whole."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from ..ema import ModelEma


class HeldSwap:
    """`ema.swapped(model)` entered in one hook and left in another (Lightning's evaluation start
    and end, left also when the framework reports an exception), or around a Trainer's evaluate().
    Entering while swapped in does nothing (validation inside a test run, evaluate() inside
    ema_weights). `paused()` puts the training weights back for a moment (a checkpoint written
    while the EMA weights are in the model)."""

    def __init__(self):
        self._stack = contextlib.ExitStack()
        self.target = None  # (ema, model) while swapped in

    def enter(self, ema: ModelEma, model):
        """The model the EMA weights went into (ema.swapped's), or None if already swapped in."""
        if self.target is not None:
            return None
        swapped = self._stack.enter_context(ema.swapped(model))
        self.target = (ema, model)
        return swapped

    def leave(self) -> None:
        self.target = None
        self._stack.close()

    @contextlib.contextmanager
    def paused(self):
        """Training weights in the model (and the EMA's own tensors holding the EMA) for the
        block; the EMA weights go back in after it. Yields whether a swap was paused."""
        target = self.target
        self.leave()
        try:
            yield target is not None
        finally:
            if target is not None:
                self.enter(*target)


def hold_ema(callback, ema, decay, ema_kwargs: dict, **flags) -> None:
    """A callback's EMA arguments, checked now with ModelEma's own messages instead of at the first
    training step (a throwaway EMA of a one-parameter module; device left out: the callback is
    often built before the devices are set up, and a CUDA device must not be touched here), set
    on it: the True/False `flags` as attributes, `ema` (the caller's ModelEma, or None until one
    is built from `_ema_kwargs`, which is None for the caller's) and `_swap`, a HeldSwap."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    kwargs = None
    if ema is not None:
        if not isinstance(ema, ModelEma):
            raise TypeError(f"ema must be a fused_ema.ModelEma, got {type(ema).__name__}")
        if ema_kwargs or decay is not None:
            raise ValueError(
                "pass either a ModelEma (ema=) or its keywords (decay=, ...), not both"
            )
    else:
        kwargs = {**ema_kwargs, **({} if decay is None else {"decay": decay})}
        probe = {key: value for key, value in kwargs.items() if key != "device"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ModelEma(nn.Linear(1, 1, bias=False, dtype=torch.float32), **probe)
    vars(callback).update(flags, ema=ema, _ema_kwargs=kwargs, _swap=HeldSwap())


def whole_state_dict(ema) -> dict:
    """ema.state_dict(), with the weights of each EMA that a DeepSpeed ZeRO-3 model partitions over
    the ranks gathered whole (every process must call this); any rank then loads it, each taking
    its partition."""
    state = ema.state_dict()
    tracks = list(getattr(ema, "_tracks", (ema,)))
    if not any(t._binding.zero3() for t in tracks):
        return state
    whole = [t.full_state_dict(rank=None) for t in tracks]
    if "emas" in state:  # PostHocEma / Bema: one state dict per track
        state["emas"] = [{**sd, "weights": w} for sd, w in zip(state["emas"], whole)]
    else:
        state["weights"] = whole[0]
    return state
