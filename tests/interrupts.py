"""Interrupts at every point of a call, deterministically: InterruptAt raises KeyboardInterrupt
where CPython can run a signal handler, InterruptAtLine at every line of fused_ema's own Python
code; interrupted_everywhere() runs a call once per point. Shared by the fault tests of ModelEma,
PostHocEma and Bema."""

import collections
import itertools
import os
import sys

import pytest
import torch

import fused_ema

# Each place in the code (a line, a call site) is a point at its first PASSES passes only: a
# loop's first iteration and a later one. Every pass of every loop would make a call of N points
# cost N**2 / 2 traced steps (4,500 lines in one update that follows a new structure: minutes).
PASSES = 2


class _Point:
    """Counts the points a call reaches and raises KeyboardInterrupt at the n-th (n from 1)."""

    def __init__(self, n: int):
        self.n, self.seen, self.grad_when_fired = n, 0, None
        self.passes = collections.Counter()

    def reached(self, place) -> None:
        self.passes[place] += 1
        if self.passes[place] <= PASSES:
            self.seen += 1
            if self.seen == self.n:
                self.grad_when_fired = torch.is_grad_enabled()
                raise KeyboardInterrupt


class InterruptAt(_Point):
    """A profile function (sys.setprofile) that raises KeyboardInterrupt at the n-th point of the
    profiled call where CPython can run a signal handler: a Python function starting ("call",
    its RESUME) or a call into C returning ("c_return", the check after a CALL). Profiling stops
    once it has raised, so each run is interrupted once, as by one signal."""

    install = staticmethod(sys.setprofile)

    def __call__(self, frame, event, arg):
        if event in ("call", "c_return"):
            self.reached((event, frame.f_code, frame.f_lasti))  # (f_lasti: the call site)


FUSED_EMA_SOURCES = os.path.dirname(fused_ema.__file__) + os.sep


class InterruptAtLine(_Point):
    """A trace function (sys.settrace) that raises KeyboardInterrupt at the n-th line of
    fused_ema's own Python code that the traced call runs, wherever that is: also where no
    signal handler can run (inside a finally block, before its first call), so it finds any
    window in which Python code has switched a mode and not yet switched it back. Tracing stops
    once it has raised (CPython drops a trace function that raises)."""

    install = staticmethod(sys.settrace)

    def __call__(self, frame, event, arg):
        if event == "call":
            return self if frame.f_code.co_filename.startswith(FUSED_EMA_SOURCES) else None
        if event == "line":
            self.reached((frame.f_code, frame.f_lineno))
        return self


def interrupted_everywhere(
    call, after_each=lambda interrupted: None, limit=100_000, point=InterruptAt
):
    """Runs `call()` interrupted at its 1st, 2nd, 3rd... `point` (InterruptAt or
    InterruptAtLine), then once more past its last one (it completes), calling
    `after_each(interrupted)` after every run. Returns the hooks that fired."""
    fired = []
    for n in itertools.count(1):
        assert n < limit, "the call never completed"
        hook = point(n)
        point.install(hook)
        try:
            call()
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            point.install(None)
        after_each(interrupted)
        if hook.seen < n:  # it ran to its end without reaching the n-th point
            assert not interrupted
            return fired
        fired.append(hook)


# CPython prints and drops an interrupt that lands in a weakref callback or __del__ run inside
# the call (as it does a real signal's); pytest would warn about each.
ignore_dropped = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def interrupted_updates(update, model, went_through, seed: int, point=InterruptAt) -> list:
    """interrupted_everywhere() over `update()`, the model's weights moved by fresh random steps
    before each run; after each, `went_through(interrupted)` checks the state and says whether
    the update happened. Both an interrupted no-op and a completed update must be seen."""
    g = torch.Generator().manual_seed(seed)
    outcomes = set()

    def perturb():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    def after_each(interrupted):
        outcomes.add((interrupted, went_through(interrupted)))
        perturb()

    perturb()
    fired = interrupted_everywhere(update, after_each, point=point)
    assert (True, False) in outcomes and (False, True) in outcomes, outcomes
    return fired
