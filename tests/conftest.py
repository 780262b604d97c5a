"""Shared test fixtures: the device list (cuda only where it exists), the dtype pairs, and an
independent float64 reference for the lerp."""

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
