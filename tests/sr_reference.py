"""NumPy reference of fused_ema's stochastic rounding (csrc/stochastic_round.h), written from its
definition rather than its code: Philox4x32-10 random words per element, timm's bfloat16 scheme,
and float16 rounding chosen from the two neighbouring halves by exact float64 arithmetic."""

import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
ROUNDS = 10
MASK32 = np.uint64(0xFFFFFFFF)
WORDS_PER_CALL = 4


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on arrays of counters (uint32), returning four uint32 arrays."""
    c = [np.asarray(x, dtype=np.uint32) for x in (c0, c1, c2, c3)]
    k0, k1 = np.uint32(k0), np.uint32(k1)
    with np.errstate(over="ignore"):
        for _ in range(ROUNDS):
            p0 = M0 * c[0].astype(np.uint64)
            p1 = M1 * c[2].astype(np.uint64)
            hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), (p0 & MASK32).astype(np.uint32)
            hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), (p1 & MASK32).astype(np.uint32)
            c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
            k0 = np.uint32(k0 + W0)
            k1 = np.uint32(k1 + W1)
    return c


def element_words(seed, step, key, offset, n):
    """The random word of elements offset .. offset+n-1 of a tensor (stochastic_round.h)."""
    seed &= (1 << 64) - 1
    step &= (1 << 64) - 1
    elements = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    groups = elements // np.uint64(WORDS_PER_CALL)
    k0 = (seed & 0xFFFFFFFF) ^ (step >> 32)
    k1 = seed >> 32
    words = philox4x32_10(
        (groups & MASK32).astype(np.uint32),
        (groups >> np.uint64(32)).astype(np.uint32),
        np.full(n, key, dtype=np.uint32),
        np.full(n, step & 0xFFFFFFFF, dtype=np.uint32),
        k0,
        k1,
    )
    lane = (elements % np.uint64(WORDS_PER_CALL)).astype(np.int64)
    return np.choose(lane, words).astype(np.uint32)


def round_bf16(values, words):
    """timm 1.0.31: add 16 random bits below the kept half, truncate; NaN to nearest (0x7FC0)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    out = ((bits + (words.astype(np.uint64) & np.uint64(0xFFFF))) >> np.uint64(16)).astype(
        np.uint16
    )
    return np.where(np.isnan(values), np.uint16(0x7FC0), out)


HALF_MAX = 65504.0
HALF_OVERFLOW = 65536.0


def round_f16(values, words):
    """The half above |value| with probability (|value| - below) / (above - below), truncated to
    32 bits: chosen by word < floor(2**32 * fraction). Returns uint16 bits."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _round_f16(values, words)


def _round_f16(values, words):
    r = np.asarray(values, dtype=np.float32)
    mag = np.abs(r).astype(np.float64)
    nearest = np.abs(r.astype(np.float16)).astype(np.float64)
    # The half toward zero from |r| (round-to-nearest may have gone up).
    step_down = np.where(
        nearest > mag,
        np.nextafter(nearest.astype(np.float16), np.float16(0)).astype(np.float64),
        nearest,
    )
    below = np.where(np.isinf(nearest) & (mag < HALF_OVERFLOW), HALF_MAX, step_down)
    finite = np.isfinite(mag) & (mag < HALF_OVERFLOW)
    below = np.where(finite, below, 0.0)
    above = np.nextafter(below.astype(np.float16), np.float16(np.inf)).astype(np.float64)
    above = np.where(np.isinf(above), HALF_OVERFLOW, above)
    fraction = np.where(finite, (mag - below) / (above - below), 0.0)
    threshold = np.floor(fraction * 2.0**32).astype(np.uint64)
    up = words.astype(np.uint64) < threshold
    low_bits = below.astype(np.float16).view(np.uint16)
    bits = (low_bits + up.astype(np.uint16)).astype(np.uint16)
    rn_bits = np.abs(r.astype(np.float16)).view(np.uint16)
    bits = np.where(finite, bits, np.where(np.isnan(r), np.uint16(0x7E00), rn_bits))
    sign = (r.view(np.uint32) >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000)
    return (bits | sign).astype(np.uint16)


def stochastic_round(values, dtype, seed, step, key, offset=0):
    """uint16 bits of float32 `values` rounded as fused_ema rounds an EMA of `dtype` ('bfloat16'
    or 'float16') whose elements start at `offset` in the full tensor."""
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    words = element_words(seed, step, key, offset, values.size)
    return round_bf16(values, words) if dtype == "bfloat16" else round_f16(values, words)
