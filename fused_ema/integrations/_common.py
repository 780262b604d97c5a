"""What the framework integrations share: the ModelEma keyword check at construction, and an
EMA's state dict with DeepSpeed ZeRO-3 partitions gathered whole."""

from __future__ import annotations

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
