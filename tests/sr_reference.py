"""NumPy reference of fused_ema's stochastic rounding (csrc/stochastic_round.h), written from its
definition rather than its code: 16 random bits per element (half of a keyed 32-bit hash of the
element's pair), timm's bfloat16 scheme, and float16 rounding chosen from the two neighbouring
halves by exact float64 arithmetic."""

import numpy as np

U64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
M1, M2 = np.uint32(0x21F0AAAD), np.uint32(0x735A2D97)


def splitmix64(x):
    """splitmix64's next output from state x (Python ints: keys are per tensor, not per element)."""
    z = (x + GOLDEN) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def pair_key(seed, step, key, hi):
    """The 64-bit key of the pairs whose index has high word `hi`."""
    h = splitmix64(seed & U64)
    h = splitmix64(h ^ (step & U64))
    return splitmix64(h ^ ((hi << 32) | (key & 0xFFFFFFFF)))


def pair_bits(lo, k):
    """lowbias32 (hash-prospector's 0x21f0aaad/0x735a2d97) of lo * 0x9E3779B9 + k mod 2**32,
    the key's high word xored in after the first multiply; lo a uint32 array."""
    x = np.asarray(lo, dtype=np.uint32) * np.uint32(0x9E3779B9) + np.uint32(k & 0xFFFFFFFF)
    x ^= x >> np.uint32(16)
    x *= M1
    x ^= (x >> np.uint32(15)) ^ np.uint32(k >> 32)
    x *= M2
    return x ^ (x >> np.uint32(15))


def element_words(seed, step, key, offset, n):
    """The 16 random bits of elements offset .. offset+n-1 of a tensor (uint32 array): element e
    takes half e % 2 (low, then high) of its pair's bits, the pair p = e // 2 keyed by p's high
    word."""
    elements = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    pairs = elements >> np.uint64(1)
    his = pairs >> np.uint64(32)
    bits = np.empty(n, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for hi in np.unique(his):
            where = his == hi
            k = pair_key(seed, step, key, int(hi))
            bits[where] = pair_bits(pairs[where].astype(np.uint32), k)
    shift = ((elements & np.uint64(1)) * np.uint64(16)).astype(np.uint32)
    return (bits >> shift) & np.uint32(0xFFFF)


def round_bf16(values, words):
    """timm 1.0.31: add 16 random bits below the kept half, truncate; NaN to nearest (0x7FC0)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    out = ((bits + words.astype(np.uint64)) >> np.uint64(16)).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), out)


HALF_MAX = 65504.0
HALF_OVERFLOW = 65536.0


def round_f16(values, words):
    """The half above |value| with probability (|value| - below) / (above - below), truncated to
    16 bits: chosen by word < floor(2**16 * fraction). Returns uint16 bits."""
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
    threshold = np.floor(fraction * 2.0**16).astype(np.uint64)
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
