"""The test-only ops, kept out of fused_ema._C and torch.ops.fused_ema: the random stream and the
stochastic rounding of csrc/stochastic_round.h, and the CUDA launch-parameter size switch.
They are torch.ops.fused_ema_testing.* (csrc/testing/), which importing fused_ema registers."""

from __future__ import annotations

import torch

import fused_ema  # noqa: F401  (loads fused_ema._C, which registers the fused_ema_testing ops)

_U64 = (1 << 64) - 1


def _int64(value: int, mask: int = _U64) -> int:
    """`value` modulo 2**64 (or `mask` + 1) as the int64 a torch op takes (two's complement)."""
    value = int(value) & mask
    return value - (1 << 64) if value >= 1 << 63 else value


def sr_words(seed: int, step: int, key: int, offset: int, n: int) -> torch.Tensor:
    """The 16 random bits (int32 tensor) of elements offset .. offset + n - 1 of tensor `key` at
    (seed, step); seed, step and offset are taken modulo 2**64, key modulo 2**32."""
    return torch.ops.fused_ema_testing.sr_words(
        _int64(seed), _int64(step), _int64(key, 0xFFFFFFFF), _int64(offset), n
    )


def stochastic_round(values, dtype: str, seed: int, step: int, key: int, offset: int):
    """float32 CPU `values` rounded stochastically to `dtype` ("bfloat16" | "float16"), element i
    with the random word of element offset + i of tensor `key` at (seed, step); seed, step and
    offset are taken modulo 2**64, key modulo 2**32, as the kernels take them."""
    return torch.ops.fused_ema_testing.stochastic_round(
        values, dtype, _int64(seed), _int64(step), _int64(key, 0xFFFFFFFF), _int64(offset)
    )


def cuda_small_params(flag=None) -> bool:
    """Keeps CUDA launches at 4 KB of parameters (flag true) or lets them take 32 KB where the
    device allows (flag false) and returns the previous setting; no flag only reads it. False
    in a build without the CUDA kernel."""
    return torch.ops.fused_ema_testing.cuda_small_params(-1 if flag is None else int(bool(flag)))
