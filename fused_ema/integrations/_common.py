"""What both framework callbacks share: the ModelEma keyword check at construction."""

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
