"""Shared test fixtures: the device list (cuda only where it exists), the dtype pairs, an
independent float64 reference for the lerp, and a guard that no test leaves the process-wide
state it could disturb (grad mode, inference mode, the SIGALRM handler and timer) changed."""

import signal
import threading

import pytest
import torch

import fused_ema

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPE_PAIRS = list(fused_ema.SUPPORTED_DTYPE_PAIRS)
SAME_DTYPE_PAIRS = [(e, s) for e, s in DTYPE_PAIRS if e == s]


def pair_id(pair):
    ema, src = pair
    return f"{str(ema).split('.')[-1]}<-{str(src).split('.')[-1]}"


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=DTYPE_PAIRS, ids=pair_id)
def dtype_pair(request):
    return request.param


def _global_state() -> dict:
    state = {
        "grad mode (torch.is_grad_enabled())": torch.is_grad_enabled(),
        "inference mode (torch.is_inference_mode_enabled())": torch.is_inference_mode_enabled(),
    }
    if hasattr(signal, "SIGALRM"):
        state["the SIGALRM handler"] = signal.getsignal(signal.SIGALRM)
        state["an armed ITIMER_REAL timer"] = signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0)
    return state


def _restore_global_state(before: dict) -> None:
    """What can be put back from here (inference mode is a guard object: only its owner ends it)."""
    torch.set_grad_enabled(before["grad mode (torch.is_grad_enabled())"])
    if hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread():
        if not before["an armed ITIMER_REAL timer"]:
            signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before["the SIGALRM handler"])


@pytest.fixture(autouse=True)
def leaves_global_state_as_found():
    """Every test: what it changed of the process-wide state is put back where it can be, so it
    cannot break the tests after it (a grad mode left off fails dozens of them with "element 0 of
    tensors does not require grad"), and the test that changed it fails, naming what."""
    before = _global_state()
    yield
    after = _global_state()
    changed = [f"{k}: {before[k]!r} -> {after[k]!r}" for k in before if after[k] != before[k]]
    if changed:
        _restore_global_state(before)
        pytest.fail("the test left process-wide state changed: " + "; ".join(changed))


@pytest.fixture
def restore_cpu_isa():
    previous = fused_ema.cpu_isa()
    yield
    fused_ema.set_cpu_isa(previous)


def lerp_reference(ema: torch.Tensor, src: torch.Tensor, weight: float) -> torch.Tensor:
    """ema + weight * (src - ema) in float64, from the inputs before the update."""
    e = ema.detach().to("cpu", torch.float64)
    s = src.detach().to("cpu", torch.float64)
    return e + weight * (s - e)


def assert_lerp_close(result: torch.Tensor, ema_before: torch.Tensor, src: torch.Tensor, weight):
    """The update is right to within the EMA dtype's rounding of each input's magnitude.

    The kernel computes in float (double for float64): one rounding of src - ema, one fused
    multiply-add and one rounding to the EMA dtype. Each is bounded by eps * (|ema| + |src|)."""
    weight = float(weight)
    ref = lerp_reference(ema_before, src, weight)
    got = result.detach().to("cpu", torch.float64)
    scale = (
        ema_before.detach().to("cpu", torch.float64).abs()
        + src.detach().to("cpu", torch.float64).abs()
    )
    eps = torch.finfo(result.dtype).eps
    bound = eps * scale + torch.finfo(result.dtype).tiny
    err = (got - ref).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} elements off; worst error {float(err.max()):.3e} "
        f"(bound {float(bound[bad].min()):.3e})"
    )


def random_tensor(shape, dtype, device, generator=None):
    """Fresh normal data, never zeros; a few larger magnitudes to exercise rounding."""
    t = torch.randn(shape, dtype=torch.float64, generator=generator)
    t = t * torch.exp2(torch.randint(-4, 5, shape, generator=generator).double())
    return t.to(dtype).to(device)
