"""Autograd off for fused_ema's own work, and the caller's grad mode put back whatever happens,
an interrupt included: `without_grad(fn, *args)` is fused_ema._C.without_grad, a C++ guard around
the call (csrc/grad_mode.cpp), where `with torch.no_grad():`'s Python __enter__ / __exit__ can be
split by an interrupt, leaving autograd off (docs/guarantees.md; tests/test_ema_faults.py)."""

import functools

import torch

from .loader import _C

without_grad = _C.without_grad


def outside_inference_mode(fn):
    """`fn` making normal tensors even when called under torch.inference_mode(): the EMA's own
    tensors are written outside that mode too (Lightning evaluates under it). The mode is switched
    only there: its context manager is Python, which an interrupt can split."""

    @functools.wraps(fn)
    def normal(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            return fn(*args, **kwargs)

    return normal
