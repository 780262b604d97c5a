"""csrc/stochastic_round.h: its random stream matches known answers and the NumPy reference
(tests/sr_reference.py), its bfloat16/float16 rounding matches the reference bit for bit over every
kind of value, is unbiased, and the header compiles for the GPU with plain nvcc. The statistics of
the stream are tests/test_sr_stream_quality.py's."""

import subprocess

import numpy as np
import pytest
import sr_reference as ref
import torch
from test_cuda_compile import NVCC, ROOT

from testing_ops import sr_words, stochastic_round

# splitmix64's published outputs from state 1234567 (its successive states: + the golden gamma).
SPLITMIX64_KAT = [
    6457827717110365317,
    3203168211198807973,
    9817491932198370423,
    4593380528125082431,
    16408922859458223821,
]
# The stream itself, pinned: (seed, step, key, offset) -> the words of 8 elements from offset on.
STREAM_KAT = [
    ((0, 0, 0, 0), [1946, 22303, 23303, 46683, 60420, 12675, 64394, 51022]),
    # An odd offset, across a block of 2**32 pairs (its last 3 elements, the next block's first 3)
    ((2**64 - 1, 2**40 + 5, 2**32 - 1, 2**33 - 3), [58547, 46653, 49681, 48068, 26380, 43901]),
]
SR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def test_splitmix64_known_answers():
    state, out = 1234567, []
    for _ in SPLITMIX64_KAT:
        out.append(ref.splitmix64(state))
        state = (state + ref.GOLDEN) & ref.U64
    assert out == SPLITMIX64_KAT


@pytest.mark.parametrize("args, expected", STREAM_KAT)
def test_stream_known_answers(args, expected):
    assert sr_words(*args, len(expected)).tolist() == expected
    assert ref.element_words(*args, len(expected)).tolist() == expected


@pytest.mark.parametrize(
    "seed, step, key, offset",
    [
        (0, 0, 0, 0),
        (2**64 - 1, 2**64 - 1, 2**32 - 1, 2**33 - 500),  # across a block of 2**32 pairs
        (-5, -1, 3, 2**62 + 1),
    ],
)
def test_stream_matches_reference(seed, step, key, offset):
    got = sr_words(seed, step, key, offset, 1000).numpy()
    np.testing.assert_array_equal(got, ref.element_words(seed, step, key, offset, 1000))
    assert got.min() >= 0 and got.max() < 2**16


def test_stream_matches_reference_on_random_inputs():
    rng = np.random.default_rng(0)
    for _ in range(100):
        seed, step = (int(x) for x in rng.integers(0, 2**64, 2, dtype=np.uint64))
        key = int(rng.integers(0, 2**32))
        offset = int(rng.integers(0, 2**63))
        got = sr_words(seed, step, key, offset, 37).numpy()
        np.testing.assert_array_equal(got, ref.element_words(seed, step, key, offset, 37))


def special_values():
    """Every kind of float32 an EMA can hold, around both formats' edges."""
    f32 = np.finfo(np.float32)
    half_edges = [
        65504.0,
        65505.0,
        65519.0,
        65520.0,
        65535.9,
        65536.0,
        1e6,  # largest half and beyond
        6.103515625e-05,
        6.0e-05,
        5.960464477539063e-08,
        2.9802322e-08,
        1e-9,
        1e-30,  # subnormals
        2.0**-25,
        3 * 2.0**-26,
        2.0**-24 * 1.5,
    ]
    values = [
        0.0,
        1.0,
        1.0 + 2**-10,
        1.0 + 2**-23,
        1 / 3,
        3.14159,
        1e-3,
        1e30,
        f32.max,
        f32.tiny,
        f32.tiny / 8,
        f32.smallest_subnormal,
        np.inf,
        np.nan,
        3.3895314e38,
        *half_edges,
    ]
    values = np.array(values, dtype=np.float32)
    return np.concatenate([values, -values])


def random_values(n, seed):
    """Random float32 bit patterns (NaN, inf and subnormals included) and ordinary magnitudes."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ordinary = (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n)).astype(np.float32)
    return np.concatenate([bits, ordinary, special_values()])


def c_round(values, dtype, seed, step, key, offset):
    out = stochastic_round(torch.from_numpy(values), dtype, seed, step, key, offset)
    assert out.dtype == SR_DTYPES[dtype]
    return out.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("dtype", sorted(SR_DTYPES))
@pytest.mark.parametrize(
    "seed, step, key, offset",
    [(0, 0, 0, 0), (1, 1, 7, 3), (2**64 - 1, 2**40 + 5, 2**32 - 1, 2**33 + 1), (-5, -1, 3, 10)],
)
def test_rounding_matches_reference(dtype, seed, step, key, offset):
    values = random_values(20_000, seed=key)
    expected = ref.stochastic_round(values, dtype, seed, step, key, offset)
    np.testing.assert_array_equal(c_round(values, dtype, seed, step, key, offset), expected)


# Significand bits kept after the leading one, and the smallest step (float16 subnormals).
KEPT_BITS = {"bfloat16": 7, "float16": 10}
SMALLEST_STEP = {"bfloat16": 0.0, "float16": 2.0**-24}


def to_float64(bits, dtype):
    return torch.from_numpy(bits.view(np.int16)).view(SR_DTYPES[dtype]).double().numpy()


@pytest.mark.parametrize("dtype", sorted(SR_DTYPES))
def test_rounding_picks_a_neighbour_and_keeps_representable_values(dtype):
    values = random_values(20_000, seed=1)
    values = values[np.isfinite(values) & (np.abs(values) < 6e4) & (np.abs(values) > 1e-37)]
    exact = values.astype(np.float64)
    rounded = to_float64(c_round(values, dtype, 3, 4, 5, 0), dtype)
    _, exponent = np.frexp(np.abs(exact))
    step = np.maximum(np.ldexp(1.0, exponent - 1 - KEPT_BITS[dtype]), SMALLEST_STEP[dtype])
    assert np.all(np.abs(rounded - exact) < step)
    # Values the format holds exactly come back unchanged, whatever the random word.
    held = torch.from_numpy(values).to(SR_DTYPES[dtype]).float().numpy()
    np.testing.assert_array_equal(to_float64(c_round(held, dtype, 9, 9, 9, 0), dtype), held)


@pytest.mark.parametrize("dtype", sorted(SR_DTYPES))
@pytest.mark.parametrize("value", [1.0 + 2**-12, 0.1, -3.0e-6, 1.0e-7, 65500.0])
def test_rounding_is_unbiased(dtype, value):
    """Over 2**16 elements (independent words), the mean rounded value is the value: within 4
    standard errors of a two-point draw one step wide."""
    n = 2**16
    values = np.full(n, value, dtype=np.float32)
    rounded = to_float64(c_round(values, dtype, 11, 12, 13, 0), dtype)
    lo, hi = rounded.min(), rounded.max()
    p = (float(np.float32(value)) - lo) / (hi - lo) if hi > lo else 0.0
    standard_error = (hi - lo) * np.sqrt(max(p * (1 - p), 1.0 / n) / n)
    assert abs(rounded.mean() - float(np.float32(value))) <= 4 * standard_error


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_header_compiles_for_the_device(arch, tmp_path):
    source = tmp_path / "sr_check.cu"
    source.write_text(
        '#include "stochastic_round.h"\n'
        "namespace sr = fused_ema::sr;\n"
        "__global__ void sr_check(const unsigned* in, unsigned short* out, size_t n) {\n"
        "  const size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;\n"
        "  if (i >= n) return;\n"
        "  const unsigned word = sr::element_word(1, 2, 3, i);\n"
        "  if (word != sr::TensorStream(sr::step_key(1, 2), 3, 0).word(i)) return;\n"
        "  out[2 * i] = sr::round_bf16(in[i], word);\n"
        "  out[2 * i + 1] = sr::round_f16(in[i], word);\n"
        "}\n"
    )
    cmd = [
        NVCC, "-std=c++17", "-O3", f"-I{ROOT / 'csrc'}",
        "-gencode", f"arch=compute_{arch},code=sm_{arch}",
        "-Werror", "all-warnings", "-c", str(source), "-o", str(tmp_path / "sr.o"),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
