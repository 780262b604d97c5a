"""Autograd off for fused_ema's own work, and the caller's grad mode put back whatever happens,
an interrupt included (a signal handler raising KeyboardInterrupt lands between bytecodes).

`with torch.no_grad():` cannot promise that: its __enter__ and __exit__ are Python functions, so
an interrupt can land in __enter__ after grad mode was switched off (the with block never starts
and __exit__ never runs) or at the start of __exit__ before it is switched back, and the caller
is left with autograd off. Every such block in fused_ema is written instead as

    grad = grad_enabled()
    try:
        set_grad_enabled(False)
        ...
    finally:
        set_grad_enabled(grad)

Both are C functions (no Python frame of their own to interrupt). The mode is read before the
try and changed inside it; the finally's first call puts it back. CPython (3.11+) runs signal
handlers only at a Python function's start, at a backward jump and after a call returns, and
enters an exception handler without running them, so nothing can interrupt between entering the
finally and that call; an interrupt right after it propagates with the mode already restored.
tests/test_ema_faults.py interrupts public calls at every such point and checks the mode."""

import torch

grad_enabled = torch.is_grad_enabled  # a C function
# Private, and the README says so: torch.set_grad_enabled is a class whose Python __init__ an
# interrupt can split before it switches the mode; this is the C function that __init__ calls.
set_grad_enabled = torch._C._set_grad_enabled


def without_grad(fn, *args):
    """fn(*args) with autograd off, the caller's mode put back as above."""
    grad = grad_enabled()
    try:
        set_grad_enabled(False)
        return fn(*args)
    finally:
        set_grad_enabled(grad)
