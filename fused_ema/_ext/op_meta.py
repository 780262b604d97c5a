"""What the fused ops accept, told from metadata alone: the prefixes of their messages, the dtype
pairs the kernels support, and the fake kernels that let torch.compile and FakeTensorMode trace
the ops, with the C++ checks' messages (csrc/lerp_plan.cpp, csrc/schedule.cpp)."""

from __future__ import annotations

import torch

from .loader import _C

#: (ema dtype, src dtype) pairs the kernels support; a float32 EMA may follow a 16-bit model.
#: The list is the C++ one (csrc/dtype_pair_list.h), so the two cannot drift apart.
SUPPORTED_DTYPE_PAIRS = tuple((getattr(torch, e), getattr(torch, s)) for e, s in _C.DTYPE_PAIRS)
SR_OP = "fused_ema.lerp_stochastic_: "
MANY_OP = "fused_ema.lerp_many_: "
BEMA_OP = "fused_ema.bema_: "
BEMA_LISTS = ("ema", "theta0", "out")


def weight_type_error(weight) -> str:
    return f"fused_ema.lerp_: weight must be a float or a 0-dim tensor, got {type(weight).__name__}"


@torch.library.register_fake("fused_ema::lerp_")
def _lerp_fake(ema: list[torch.Tensor], src: list[torch.Tensor], weight) -> None:
    if isinstance(weight, (bool, complex)):
        raise TypeError(weight_type_error(weight))
    _check_fake(ema, src)


@torch.library.register_fake("fused_ema::lerp_.Tensor")
def _lerp_tensor_fake(ema: list[torch.Tensor], src: list[torch.Tensor], weight: torch.Tensor):
    _check_fake(ema, src)
    if weight.numel() != 1 or weight.dtype not in (torch.float32, torch.float64):
        raise ValueError("fused_ema.lerp_: a tensor weight must be one float32/float64 element")
    _refuse_meta("fused_ema.lerp_: ", [weight])


@torch.library.register_fake("fused_ema::lerp_stochastic_")
def _lerp_stochastic_fake(ema, src, weight, step, seed, keys, offsets) -> None:
    """The metadata checks of csrc/fused_op.cpp (lerp_stochastic_), with the same messages."""
    _check_fake(ema, src)
    if weight.numel() != 1 or weight.dtype not in (torch.float32, torch.float64):
        raise ValueError("fused_ema.lerp_: a tensor weight must be one float32/float64 element")
    if step.numel() != 1 or step.dim() > 1 or step.dtype != torch.int64:
        raise ValueError(
            f"{SR_OP}step must be one int64 element (a 0-dim tensor), got {_dtype_name(step)} "
            f"of shape {list(step.shape)}"
        )
    for name, values in (("keys", keys), ("offsets", offsets)):
        if len(values) != len(ema):
            raise ValueError(
                f"{SR_OP}{name} has {len(values)} entries but ema has {len(ema)} tensors"
            )
    _refuse_meta(SR_OP, [weight, step])


@torch.library.register_fake("fused_ema::lerp_many_")
def _lerp_many_fake(emas, src, weights) -> None:
    """The metadata checks of csrc/fused_op.cpp, with the same messages."""
    _check_tracks_fake(emas, src, weights)


@torch.library.register_fake("fused_ema::lerp_many_stochastic_")
def _lerp_many_stochastic_fake(emas, src, weights, step, seeds, keys, offsets) -> None:
    tracks = _check_tracks_fake(emas, src, weights)
    if step.numel() != 1 or step.dim() > 1 or step.dtype != torch.int64:
        raise ValueError(
            f"{MANY_OP}step must be one int64 element (a 0-dim tensor), got {_dtype_name(step)} "
            f"of shape {list(step.shape)}"
        )
    emas_text = f"emas has {len(emas)} tensors (one key per EMA tensor, track k's tensor i at "
    for name, values, count, expected in (
        ("seeds", seeds, tracks, f"there are {tracks} tracks (one seed per track)"),
        ("keys", keys, len(emas), emas_text + "k * len(src) + i)"),
        ("offsets", offsets, len(src), f"src has {len(src)} tensors"),
    ):
        if len(values) != count:
            raise ValueError(f"{MANY_OP}{name} has {len(values)} entries but {expected}")
    _refuse_meta(MANY_OP, [step])


def _check_tracks_fake(emas, src, weights) -> int:
    """lerp_many_'s checks of the weights and of every (EMA, src) pair; returns K."""
    if weights.dim() != 1 or weights.numel() < 1:
        raise ValueError(
            f"{MANY_OP}weights must be a 1-D tensor of one weight per track (at least one), got "
            f"shape {list(weights.shape)}"
        )
    tracks = weights.numel()
    if len(emas) != tracks * len(src):
        raise ValueError(
            f"{MANY_OP}emas has {len(emas)} tensors but {tracks} weights of {len(src)} src "
            f"tensors need {tracks * len(src)} (track k's tensor i at k * len(src) + i)"
        )
    if weights.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{MANY_OP}weights must be float32 or float64, got {_dtype_name(weights)}")
    _check_fake(emas, src, MANY_OP, tensors=len(src))
    _refuse_meta(MANY_OP, [weights])
    return tracks


@torch.library.register_fake("fused_ema::bema_")
def _bema_fake(ema, theta0, out, src, weights) -> None:
    """The metadata checks of csrc/fused_op.cpp and the planner, with the same messages."""
    lists = (ema, theta0, out)
    for tensors, name in zip(lists, BEMA_LISTS):
        if len(tensors) != len(src):
            raise ValueError(f"{BEMA_OP}{name} has {len(tensors)} tensors but src has {len(src)}")
    for i in range(len(src)):
        for tensors, name in zip(lists[1:], BEMA_LISTS[1:]):
            if tensors[i].dtype != ema[i].dtype:
                raise ValueError(
                    f"{BEMA_OP}{name}[{i}] is {_dtype_name(tensors[i])} but ema[{i}] is "
                    f"{_dtype_name(ema[i])}; ema, theta0 and out share the EMA dtype"
                )
    if weights.dim() != 1 or weights.numel() != 3:
        raise ValueError(
            f"{BEMA_OP}weights must be a 1-D tensor of 3 elements (beta, w0, alpha), got shape "
            f"{list(weights.shape)}"
        )
    if weights.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{BEMA_OP}weights must be float32 or float64, got {_dtype_name(weights)}")
    for tensors, name in zip(lists, BEMA_LISTS):
        for i, (t, s) in enumerate(zip(tensors, src)):
            if t.device != s.device:
                raise RuntimeError(
                    f"{BEMA_OP}src[{i}] is on {s.device} but {name}[{i}] is on {t.device}"
                )
            if (t.dtype, s.dtype) not in SUPPORTED_DTYPE_PAIRS:
                raise ValueError(
                    f"{BEMA_OP}unsupported dtype pair at {name}[{i}]: ema {t.dtype}, src {s.dtype}"
                )
            if t.shape != s.shape:
                raise ValueError(
                    f"{BEMA_OP}src[{i}] has shape {list(s.shape)} but {name}[{i}] has shape "
                    f"{list(t.shape)}"
                )
        _refuse_meta(BEMA_OP, tensors)
    _refuse_meta(BEMA_OP, [weights])
    if src and weights.device.type != "cpu" and weights.device != src[0].device:
        raise RuntimeError(
            f"{BEMA_OP}weights is on {weights.device} but EMA tensors are on {src[0].device}; "
            "pass the weights on the EMAs' device, on the CPU, or as floats"
        )


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
    if config.dtype != torch.float64 or config.numel() != 12 or not config.is_contiguous():
        raise ValueError(
            f"{op}config must be 12 contiguous float64 elements (decay, min_decay, warmup_gamma, "
            "warmup_power, update_after_step, update_every, warmup_kind, update_every_decay, lag, "
            f"multiplier, ema_power, bias_power), got {_dtype_name(config)} of shape "
            f"{list(config.shape)}"
        )
    if out.device != step.device:
        raise RuntimeError(f"{op}out is on {out.device} but step is on {step.device}")
    if config.device != step.device:
        raise RuntimeError(f"{op}config is on {config.device} but step is on {step.device}")


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).split(".")[-1]


def _check_fake(ema: list, src: list, op: str = "fused_ema.lerp_: ", tensors: int = 0) -> None:
    """The metadata half of the C++ checks, so traced programs fail where eager ones would. With
    `tensors` (lerp_many_'s N), `ema` holds tracks of N tensors one after another."""
    if not tensors and len(ema) != len(src):
        raise ValueError(f"{op}ema has {len(ema)} tensors but src has {len(src)}")
    tracks = len(ema) // tensors if tensors else 1
    for k in range(tracks):
        for i, s in enumerate(src):
            e = ema[k * tensors + i]
            name = f"emas[{k}][{i}]" if tensors else f"ema[{i}]"
            if e.device != s.device:
                raise RuntimeError(f"{op}src[{i}] is on {s.device} but {name} is on {e.device}")
            if (e.dtype, s.dtype) not in SUPPORTED_DTYPE_PAIRS:
                where = name if tensors else f"index {i}"
                raise ValueError(
                    f"{op}unsupported dtype pair at {where}: ema {e.dtype}, src {s.dtype}"
                )
            if e.shape != s.shape:
                raise ValueError(
                    f"{op}src[{i}] has shape {list(s.shape)} but {name} has shape {list(e.shape)}"
                )
    _refuse_meta(op, ema)
