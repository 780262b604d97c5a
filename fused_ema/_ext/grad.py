"""Autograd off for fused_ema's own work, and the caller's grad mode put back whatever happens,
an interrupt included (a signal handler raising KeyboardInterrupt lands between bytecodes).

`without_grad(fn, *args)` is fused_ema._C.without_grad (csrc/grad_mode.cpp): a C++ guard
switches autograd off, calls fn and switches it back in its destructor, so no Python code runs
between the switch and the call or between the return and the restore, and whatever leaves fn
(a return, an error, a KeyboardInterrupt) finds the mode restored. `with torch.no_grad():` cannot
promise that: its __enter__ and __exit__ are Python functions, and an interrupt landing inside
one leaves autograd off. tests/test_ema_faults.py interrupts public calls at every point."""

from .loader import _C

without_grad = _C.without_grad
