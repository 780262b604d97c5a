"""Autograd off for fused_ema's own work, and the caller's grad mode put back whatever happens,
an interrupt included: `without_grad(fn, *args)` is fused_ema._C.without_grad, a C++ guard around
the call (csrc/grad_mode.cpp), where `with torch.no_grad():`'s Python __enter__ / __exit__ can be
split by an interrupt, leaving autograd off (docs/guarantees.md; tests/test_ema_faults.py)."""

from .loader import _C

without_grad = _C.without_grad
