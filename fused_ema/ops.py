"""The fused multi-tensor lerp: its Python entry point, the fake kernel that lets torch.compile
trace it, and build/CPU-path introspection. The checks that need every tensor run in C++
(csrc/lerp_plan.cpp), so a 20,000-tensor list costs no Python loop."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._dist.dtensor import any_dtensor, shard_lists, shard_offset
from ._ext.loader import _C
from ._version import __version__

#: (ema dtype, src dtype) pairs the kernels support; a float32 EMA may follow a 16-bit model.
#: The list is the C++ one (csrc/dtype_pair_list.h), so the two cannot drift apart.
_is_compiling = torch.compiler.is_compiling
SUPPORTED_DTYPE_PAIRS = tuple((getattr(torch, e), getattr(torch, s)) for e, s in _C.DTYPE_PAIRS)

Weight = float | torch.Tensor


def lerp_(
    ema_tensors: Sequence[torch.Tensor], src_tensors: Sequence[torch.Tensor], weight: Weight
) -> None:
    """In place, for every i: ``ema[i] += weight * (src[i] - ema[i])``, fused.

    One call updates any number of tensors: one parallel region on the CPU, one kernel launch
    per metadata batch and dtype pair on a GPU. A list may span devices and dtype pairs (see
    ``SUPPORTED_DTYPE_PAIRS``); each ``src[i]`` must be on the device of ``ema[i]`` and have its
    shape. ``weight`` is a float or a one-element float32/float64 tensor on the EMA's device (or
    the CPU), read by the kernel itself: no host sync, capturable in a CUDA graph. Results follow
    PyTorch's lerp formula in float (double for float64) and match ``torch._foreach_lerp_`` bit
    for bit on the CPU for same-dtype pairs. Bad input raises before anything is written.
    """
    ema = _tensor_list(ema_tensors, "ema_tensors")
    src = _tensor_list(src_tensors, "src_tensors")
    # Eager calls on plain tensors skip the dispatcher's per-tensor boxing (same C++ driver, same
    # checks); anything the dispatcher must see (compile, modes, subclasses) or that _lerp_eager
    # declines (unequal lengths, a weight of another type) takes the checks and torch.ops below.
    if not _is_compiling() and _C._lerp_eager(ema, src, weight):
        return
    if len(ema) != len(src):
        raise ValueError(f"fused_ema.lerp_: ema has {len(ema)} tensors but src has {len(src)}")
    # Numbers go to C++ as they are: it refuses a bool (and a non-finite weight) on every route.
    if isinstance(weight, torch.Tensor):
        op = torch.ops.fused_ema.lerp_.Tensor
    elif isinstance(weight, (float, int)):
        op = torch.ops.fused_ema.lerp_.default
    else:
        raise TypeError(_weight_type_error(weight))
    if any_dtensor(ema) or any_dtensor(src):
        ema, src = shard_lists(ema, src)
    op(ema, src, weight)


_SR_OP = "fused_ema.lerp_stochastic_: "
_INT64_RANGE = 2**64
_INT64_MIN = -(2**63)


def lerp_stochastic_(
    ema_tensors: Sequence[torch.Tensor],
    src_tensors: Sequence[torch.Tensor],
    weight: Weight,
    *,
    seed: int,
    step: int | torch.Tensor,
    keys: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
) -> None:
    """``lerp_`` with bfloat16/float16 EMAs rounded stochastically, so that updates smaller than
    half a unit in the last place still move the EMA in expectation.

    Each result is PyTorch's lerp in float, rounded up or down at random with probability
    proportional to the distance (bfloat16: timm's scheme). float32/float64 EMAs in the lists get
    the plain ``lerp_``, so one call serves a whole model. The random bits of element ``e`` of
    tensor ``i`` depend only on ``(seed, step, keys[i], offsets[i] + e)`` (Philox4x32-10), so
    results do not depend on threads, list order, devices or sharding: a shard passes the index
    of its first element in the full tensor as its offset (a DTensor sharded by rows, as FSDP2
    shards, adds its own shard's start). ``keys`` default to the list indices,
    ``offsets`` to 0. ``weight`` is a float or a one-element float32/float64 tensor, ``step`` an
    int or a one-element int64 tensor, each on the EMA's device or the CPU (read by the kernel:
    no host sync, capturable in a CUDA graph). Bad input raises before anything is written.
    """
    ema = _tensor_list(ema_tensors, "ema_tensors")
    src = _tensor_list(src_tensors, "src_tensors")
    if len(ema) != len(src):
        raise ValueError(f"fused_ema.lerp_: ema has {len(ema)} tensors but src has {len(src)}")
    if isinstance(weight, (bool, complex)) or not isinstance(weight, (float, int, torch.Tensor)):
        raise TypeError(f"{_SR_OP}weight must be a float or a 0-dim tensor, got {_type(weight)}")
    if not isinstance(weight, torch.Tensor):
        weight = torch.tensor(float(weight), dtype=torch.float64)
    if isinstance(step, bool) or not isinstance(step, (int, torch.Tensor)):
        raise TypeError(f"{_SR_OP}step must be an int or a 0-dim int64 tensor, got {_type(step)}")
    if not isinstance(step, torch.Tensor):
        step = torch.tensor(_as_int64(step, "step"), dtype=torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{_SR_OP}seed must be an int, got {_type(seed)}")
    # Lists go to the op as they are (its schema checks every item in C++): a ModelEma update
    # passes the same lists each step, with no Python loop over them.
    keys = list(range(len(ema))) if keys is None else _int_list(keys)
    offsets = [0] * len(ema) if offsets is None else _int_list(offsets)
    if any_dtensor(ema) or any_dtensor(src):
        # A DTensor's elements are numbered in the full tensor: its shard starts further on.
        if len(offsets) == len(ema):
            offsets = [o + shard_offset(e, i) for i, (o, e) in enumerate(zip(offsets, ema))]
        ema, src = shard_lists(ema, src)
    torch.ops.fused_ema.lerp_stochastic_(
        ema, src, weight, step, _as_int64(seed, "seed"), keys, offsets
    )


def _int_list(values) -> list:
    return values if isinstance(values, list) else [int(v) for v in values]


def _as_int64(value: int, name: str) -> int:
    """A 64-bit value given as a signed or unsigned int, as the int64 with the same bits."""
    if not _INT64_MIN <= value < _INT64_RANGE:
        raise ValueError(f"{_SR_OP}{name} must fit in 64 bits, got {value}")
    return value - _INT64_RANGE if value > -_INT64_MIN - 1 else value


def _type(value) -> str:
    return type(value).__name__


def _tensor_list(tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"fused_ema.lerp_: {name} must be a sequence of tensors, not a tensor")
    tensors = tensors if isinstance(tensors, list) else list(tensors)
    return tensors


def _weight_type_error(weight) -> str:
    return f"fused_ema.lerp_: weight must be a float or a 0-dim tensor, got {type(weight).__name__}"


@torch.library.register_fake("fused_ema::lerp_")
def _lerp_fake(ema: list[torch.Tensor], src: list[torch.Tensor], weight) -> None:
    if isinstance(weight, (bool, complex)):
        raise TypeError(_weight_type_error(weight))
    _check_fake(ema, src)


@torch.library.register_fake("fused_ema::lerp_.Tensor")
def _lerp_tensor_fake(ema: list[torch.Tensor], src: list[torch.Tensor], weight: torch.Tensor):
    _check_fake(ema, src)
    if weight.numel() != 1 or weight.dtype not in (torch.float32, torch.float64):
        raise ValueError("fused_ema.lerp_: a tensor weight must be one float32/float64 element")
    _refuse_meta("fused_ema.lerp_: ", [weight])


@torch.library.register_fake("fused_ema::lerp_stochastic_")
def _lerp_stochastic_fake(ema, src, weight, step, seed, keys, offsets) -> None:
    """The metadata checks of csrc/lerp_op.cpp (lerp_stochastic), with the same messages."""
    _check_fake(ema, src)
    if weight.numel() != 1 or weight.dtype not in (torch.float32, torch.float64):
        raise ValueError("fused_ema.lerp_: a tensor weight must be one float32/float64 element")
    if step.numel() != 1 or step.dim() > 1 or step.dtype != torch.int64:
        raise ValueError(
            f"{_SR_OP}step must be one int64 element (a 0-dim tensor), got {_dtype_name(step)} "
            f"of shape {list(step.shape)}"
        )
    for name, values in (("keys", keys), ("offsets", offsets)):
        if len(values) != len(ema):
            raise ValueError(
                f"{_SR_OP}{name} has {len(values)} entries but ema has {len(ema)} tensors"
            )
    _refuse_meta(_SR_OP, [weight, step])


@torch.library.register_fake("fused_ema::ema_schedule_")
def _ema_schedule_fake(step, out, config, advance) -> None:
    _check_schedule_tensors(step, out, config)
    _refuse_meta("fused_ema.ema_schedule_: ", [step])


def _refuse_meta(op: str, tensors: list[torch.Tensor]) -> None:
    """register_fake makes the fake kernels the ops' Meta kernels too: real meta tensors arrive
    here, where a silent return would pretend an update happened. FakeTensorMode (torch.compile)
    calls the fake kernels with FakeTensors of the device they stand for, which pass."""
    for t in tensors:
        if t.device.type == "meta":
            raise RuntimeError(
                f"{op}meta tensors hold no data, so there is nothing to update; run the op on "
                "tensors of a real device (torch.compile and FakeTensorMode trace it without "
                "running it)"
            )


def _check_schedule_tensors(step, out, config) -> None:
    """The tensor checks of the C++ kernels (csrc/schedule.cpp), with the same messages."""
    op = "fused_ema.ema_schedule_: "
    if step.dtype != torch.int64 or step.numel() != 1:
        raise ValueError(
            f"{op}step must be one int64 element, got {_dtype_name(step)} of shape "
            f"{list(step.shape)}"
        )
    if out.dtype != torch.float64 or out.numel() != 2 or not out.is_contiguous():
        raise ValueError(
            f"{op}out must be 2 contiguous float64 elements (weight, decay), got "
            f"{_dtype_name(out)} of shape {list(out.shape)}"
        )
    if config.dtype != torch.float64 or config.numel() != 8 or not config.is_contiguous():
        raise ValueError(
            f"{op}config must be 8 contiguous float64 elements (decay, min_decay, warmup_gamma, "
            "warmup_power, update_after_step, update_every, warmup_kind, update_every_decay), "
            f"got {_dtype_name(config)} of shape {list(config.shape)}"
        )
    if out.device != step.device:
        raise RuntimeError(f"{op}out is on {out.device} but step is on {step.device}")
    if config.device != step.device:
        raise RuntimeError(f"{op}config is on {config.device} but step is on {step.device}")


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).split(".")[-1]


def _check_fake(ema: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """The metadata half of the C++ checks, so traced programs fail where eager ones would."""
    if len(ema) != len(src):
        raise ValueError(f"fused_ema.lerp_: ema has {len(ema)} tensors but src has {len(src)}")
    for i, (e, s) in enumerate(zip(ema, src)):
        if e.device != s.device:
            raise RuntimeError(
                f"fused_ema.lerp_: src[{i}] is on {s.device} but ema[{i}] is on {e.device}"
            )
        if (e.dtype, s.dtype) not in SUPPORTED_DTYPE_PAIRS:
            raise ValueError(
                f"fused_ema.lerp_: unsupported dtype pair at index {i}: ema {e.dtype}, "
                f"src {s.dtype}"
            )
        if e.shape != s.shape:
            raise ValueError(
                f"fused_ema.lerp_: src[{i}] has shape {list(s.shape)} but ema[{i}] has shape "
                f"{list(e.shape)}"
            )
    _refuse_meta("fused_ema.lerp_: ", ema)


def build_info() -> dict:
    """What this installation compiled and runs: versions, kernels, CPU paths, CUDA archs."""
    kernels = _C.devices_with_kernels()
    return {
        "version": __version__,
        "torch_version": torch.__version__,
        "torch_version_built": _C.TORCH_VERSION_BUILT,
        "cpu_kernel": "cpu" in kernels,
        "cpu_isas_compiled": list(_C.COMPILED_CPU_ISAS),
        "cpu_isas_available": list(_C.available_cpu_isas()),
        "cpu_isa": _C.cpu_isa(),
        "cuda_kernel": "cuda" in kernels,
        "cuda_archs": list(_C.CUDA_ARCHS),
        "cuda_version_built": _C.CUDA_VERSION_BUILT,
        "cuda_available": torch.cuda.is_available(),
    }


def cpu_isa() -> str:
    """The CPU instruction set the kernels use now: "avx512", "avx2" or "default"."""
    return _C.cpu_isa()


def set_cpu_isa(isa: str) -> str:
    """Selects the CPU instruction set for later calls and returns the previous one.

    The initial choice is the best this CPU and build support, or ``FUSED_EMA_CPU_ISA``. Every
    path gives bit-identical results; this exists to check that, and to compare their speed.
    """
    previous = _C.cpu_isa()
    _C.set_cpu_isa(isa)
    return previous
