"""What the fused ops accept, told from metadata alone: the dtype pairs the kernels support, and
the fake kernels that let torch.compile and FakeTensorMode trace the ops, each running the C++
kernel's own checks."""

from __future__ import annotations

import torch

from .loader import _C

#: (ema dtype, src dtype) pairs the kernels support; a float32 EMA may follow a 16-bit model.
#: The list is the C++ one (csrc/dtype_pair_list.h), so the two cannot drift apart.
SUPPORTED_DTYPE_PAIRS = tuple((getattr(torch, e), getattr(torch, s)) for e, s in _C.DTYPE_PAIRS)


# The fused ops that write tensors. Each overload's fake kernel runs the C++ kernel's own checks,
# its twin in fused_ema_checks (csrc/fused_op_kernels.cpp, csrc/schedule.cpp): metadata only, on
# the FakeTensors' devices, so a traced call fails with the message an eager one gives.
_WRITING_OPS = "lerp_ lerp_stochastic_ lerp_many_ lerp_many_stochastic_ bema_ ema_schedule_".split()


def _register_fake(name: str, overload: str) -> None:
    qualname = f"fused_ema::{name}" + ("" if overload == "default" else f".{overload}")
    prefix = f"fused_ema.{name}: "
    check = getattr(getattr(torch.ops.fused_ema_checks, name), overload)
    names = [a.name for a in check._schema.arguments]
    # A weight or step on the meta device: refused as such before the checks call it misplaced.
    early = () if name == "ema_schedule_" else ("weight", "weights", "step")

    def fake(*args, **kwargs) -> None:
        bound = {**dict(zip(names, args)), **kwargs}
        _refuse_meta(prefix, [bound[n] for n in early if n in bound])
        check(**{n: _concrete(v) for n, v in bound.items()})
        _refuse_meta(
            prefix, [t for v in bound.values() for t in (v if isinstance(v, list) else [v])]
        )

    torch.library.register_fake(qualname)(fake)


def _concrete(value):
    """A FakeTensor of symbolic shape as one of its hinted shape (C++ reads plain sizes; the op
    checks the real shapes when it runs), in lists too; anything else as it is."""
    if isinstance(value, list):
        return [_concrete(v) for v in value]
    if not isinstance(value, torch.Tensor) or not any(
        isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride())
    ):
        return value
    return torch.empty_strided(
        [_hint(d) for d in value.shape],
        [_hint(d) for d in value.stride()],
        dtype=value.dtype,
        device=value.device,
        requires_grad=value.requires_grad,
    )


def _hint(size) -> int:
    """A size as the int it has now, without a guard where its symbol has a hint."""
    if isinstance(size, torch.SymInt) and size.node.has_hint():
        return int(size.node.hint)
    return int(size)


def _refuse_meta(op: str, values: list) -> None:
    """register_fake makes the fake kernels the ops' Meta kernels too: real meta tensors arrive
    here, where a silent return would pretend an update happened. FakeTensorMode (torch.compile)
    calls the fake kernels with FakeTensors of the device they stand for, which pass."""
    for t in values:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise RuntimeError(
                f"{op}meta tensors hold no data, so there is nothing to update; run the op on "
                "tensors of a real device (torch.compile and FakeTensorMode trace it without "
                "running it)"
            )


for _name in _WRITING_OPS:
    for _overload in getattr(torch.ops.fused_ema_checks, _name).overloads():
        _register_fake(_name, _overload)
