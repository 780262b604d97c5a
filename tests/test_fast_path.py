"""Eager calls on plain tensors skip the dispatcher's boxing (fused_ema._C._lerp_eager); anything
the dispatcher must see still goes through it. Both roads run the same C++ driver, so they give
the same bits, the same errors and the same version-counter bumps."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_ema
from fused_ema import _C


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def lists(device, n=3):
    return [torch.randn(100, device=device) for _ in range(n)], [
        torch.randn(100, device=device) for _ in range(n)
    ]


def test_fast_path_takes_plain_tensors_and_parameters(device):
    ema, src = lists(device)
    src[0] = torch.nn.Parameter(src[0])
    assert _C._lerp_eager(ema, src, 0.5) is True
    assert _C._lerp_eager(ema, src, torch.tensor(0.5, device=device)) is True


def test_fast_path_and_dispatcher_give_the_same_bits(device):
    ema, src = lists(device)
    other = [e.clone() for e in ema]
    assert _C._lerp_eager(ema, src, 0.3)
    torch.ops.fused_ema.lerp_.default(other, src, 0.3)
    for a, b in zip(ema, other):
        assert torch.equal(a, b)


def test_dispatch_modes_see_the_op(device):
    ema, src = lists(device)
    expected = [e.clone() for e in ema]
    torch._foreach_lerp_(expected, src, 0.25)
    with RecordOps() as mode:
        assert _C._lerp_eager(ema, src, 0.25) is False  # declines: a mode is active
        fused_ema.lerp_(ema, src, 0.25)
    assert "fused_ema.lerp_.default" in mode.ops
    for a, b in zip(ema, expected):
        assert torch.equal(a, b)


class Tagged(torch.Tensor):
    """A subclass with its own __torch_function__: must not be bypassed."""

    seen = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclasses_go_through_the_dispatcher(device):
    ema, src = lists(device)
    src[1] = src[1].as_subclass(Tagged)
    assert _C._lerp_eager(ema, src, 0.5) is False
    Tagged.seen = 0
    fused_ema.lerp_(ema, src, 0.5)
    assert Tagged.seen > 0


def test_meta_tensors_go_through_the_dispatcher_and_are_refused():
    ema = [torch.empty(5, device="meta")]
    src = [torch.empty(5, device="meta")]
    assert _C._lerp_eager(ema, src, 0.5) is False
    with pytest.raises(RuntimeError, match="meta tensors hold no data"):
        fused_ema.lerp_(ema, src, 0.5)  # the Meta kernel (the fake kernel) refuses them


def test_fast_path_declines_under_functorch_transforms():
    ema, src = lists("cpu", 1)

    def update(x):
        fused_ema.lerp_([x], [src[0]], 0.5)
        return x

    # vmap needs the dispatcher (batching rules); had the fast path run, it would have written
    # through the batched tensor's storage silently. The dispatcher refuses clearly instead.
    with pytest.raises(RuntimeError, match="Batching rule not implemented for fused_ema::lerp_"):
        torch.vmap(update)(torch.randn(2, 100))


def test_first_call_inside_inference_mode_then_versions_still_bump():
    """The one-time check of how versions are bumped must not depend on the first call's mode."""
    import subprocess
    import sys

    code = (
        "import torch, fused_ema\n"
        "with torch.inference_mode():\n"
        "    a, b = torch.randn(3), torch.randn(3)\n"
        "    fused_ema.lerp_([a], [b], 0.5)\n"
        "e = [torch.randn(5) for _ in range(3000)]\n"
        "s = [torch.randn(5) for _ in range(3000)]\n"
        "fused_ema.lerp_(e, s, 0.25)\n"
        "assert all(t._version == 1 for t in e), [t._version for t in e][:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_bad_pair_before_a_subclass_still_reaches_the_subclass(device):
    """The fast path checks pairs while it unpacks: a refused pair must not hide a subclass
    further down the list, whose __torch_function__ decides first on the dispatcher's road."""
    ema, src = lists(device, 4)
    ema[0] = torch.randint(0, 5, (100,), device=device)  # an integer EMA: refused
    src[3] = src[3].as_subclass(Tagged)
    before = [e.clone() for e in ema]
    assert _C._lerp_eager(ema, src, 0.5) is False
    Tagged.seen = 0
    with pytest.raises(ValueError, match=r"ema\[0\] has dtype int64"):
        fused_ema.lerp_(ema, src, 0.5)
    assert Tagged.seen > 0
    assert all(torch.equal(a, b) for a, b in zip(ema, before))


@pytest.mark.parametrize("road", ["fast path", "dispatcher"])
def test_a_bad_weight_is_reported_before_a_bad_pair(device, road):
    ema, src = lists(device)
    src[1] = torch.randn(7, device=device)  # a shape mismatch at index 1
    call = _C._lerp_eager if road == "fast path" else torch.ops.fused_ema.lerp_.default
    with pytest.raises(ValueError, match="weight must be finite"):
        call(ema, src, float("nan"))
    with pytest.raises(ValueError, match=r"src\[1\] has shape \[7\]"):
        call(ema, src, 0.5)


@pytest.mark.parametrize("count", [3000, 5001])
def test_long_lists_give_foreach_bits_and_bump_versions_once(count):
    """Past 2,048 tensors the pass prefetches ahead in stages: every tensor still counts once,
    mixed sizes and a Parameter included, and a bad pair near the end is still named."""
    gen = torch.Generator().manual_seed(count)
    sizes = torch.randint(1, 70, (count,), generator=gen).tolist()
    src = [torch.randn(n, generator=gen) for n in sizes]
    src[count // 2] = torch.nn.Parameter(src[count // 2])
    ema = [torch.randn(n, generator=gen) for n in sizes]
    expected = [e.clone() for e in ema]
    with torch.no_grad():
        torch._foreach_lerp_(expected, [s.detach() for s in src], 0.125)
    assert _C._lerp_eager(ema, src, 0.125) is True
    assert all(torch.equal(a, b) for a, b in zip(ema, expected))
    assert all(t._version == 1 for t in ema)
    src[-3] = torch.randn(sizes[-3] + 1, generator=gen)
    with pytest.raises(ValueError, match=rf"src\[{count - 3}\] has shape"):
        _C._lerp_eager(ema, src, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(ema, expected))
    assert all(t._version == 1 for t in ema)
