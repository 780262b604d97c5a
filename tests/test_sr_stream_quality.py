"""The statistics of stochastic rounding's random words, as the kernels draw them (the test-only
sr_words op, bit for bit the kernels' stream: test_stochastic_round.py, test_lerp_stochastic.py):
uniform over their 16 bits, and independent across neighbouring elements (the two halves of one
hash and the next hashes), steps, keys and seeds. Each statistic is a chi-square over 2**18 to
2**22 words, turned into a z-score (Wilson-Hilferty), and NumPy's PCG64 passes the same checks
as the control. The stream is deterministic, so so are these tests."""

import math

import numpy as np
import pytest

from testing_ops import sr_words

Z_MAX = 5.0  # one-sided: p about 3e-7 per statistic
N = 2**20
SEED, STEP, KEY = 0x5EED, 1234, 7


def chi2_z(observed, expected):
    """Wilson-Hilferty z-score of a chi-square of `observed` counts against `expected`."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = observed.size - 1
    return ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def joint_z(a, b, bits=4, shift=12):
    """z of the joint counts of `bits` bits (from `shift` up) of paired words: independent uniform
    words fill the 2**(2 * bits) cells evenly."""
    mask = (1 << bits) - 1
    cells = ((a >> shift) & mask) << bits | ((b >> shift) & mask)
    counts = np.bincount(cells, minlength=1 << 2 * bits)
    return chi2_z(counts, a.size / counts.size)


def words(n=N, seed=SEED, step=STEP, key=KEY, offset=0):
    return sr_words(seed, step, key, offset, n).numpy().astype(np.int64)


def control(n=N, salt=0):
    return np.random.default_rng(salt).integers(0, 2**16, n)


@pytest.mark.parametrize("source", ["fused_ema", "pcg64"])
def test_words_are_uniform(source):
    w = words(2**22) if source == "fused_ema" else control(2**22)
    assert chi2_z(np.bincount(w, minlength=2**16), 2**22 / 2**16) < Z_MAX  # every 16-bit value
    for shift in (0, 8):  # each byte on its own, finer
        assert chi2_z(np.bincount((w >> shift) & 0xFF, minlength=256), w.size / 256) < Z_MAX
    ones = np.array([((w >> b) & 1).sum() for b in range(16)])
    assert np.all(np.abs(ones - w.size / 2) < Z_MAX * math.sqrt(w.size / 4))


@pytest.mark.parametrize("source", ["fused_ema", "pcg64"])
@pytest.mark.parametrize("lag", [1, 2, 3, 8, 31, 32, 1024])
def test_neighbouring_elements_are_independent(source, lag):
    """Lag 1 from an even element: the two halves of one hash; odd lags also cross hashes."""
    w = words() if source == "fused_ema" else control()
    for start in (0, 1):
        a, b = w[start : N - lag : 2], w[start + lag :: 2]
        for shift in (0, 6, 12):  # low, middle and high bits of both
            assert joint_z(a, b, shift=shift) < Z_MAX, (start, shift)
    x = (w - w.mean()) / w.std()
    assert abs(float(np.mean(x[:-lag] * x[lag:]))) < Z_MAX / math.sqrt(N)


@pytest.mark.parametrize(
    "other",
    [
        {"step": STEP + 1},
        {"step": STEP + 2**32},
        {"key": KEY + 1},
        {"key": KEY ^ 0x80000000},
        {"seed": SEED + 1},
        {"offset": 2**33},  # the same pair counters under the next block's key
    ],
    ids=lambda d: ",".join(f"{k}={v:#x}" for k, v in d.items()),
)
def test_streams_of_neighbouring_steps_keys_and_seeds_are_independent(other):
    a, b = words(2**18), words(2**18, **other)
    for shift in (0, 6, 12):
        assert joint_z(a, b, shift=shift) < Z_MAX, shift
        assert joint_z(a[:-1], b[1:], shift=shift) < Z_MAX, shift


def test_one_element_over_many_steps():
    """Element e's words over consecutive steps (64 elements, 4096 steps), uniform and with no
    lag-1 dependence: what an element's rounding sees over a run."""
    steps = np.stack([words(64, step=t) for t in range(4096)])  # (steps, elements)
    assert chi2_z(np.bincount(steps.ravel() >> 8, minlength=256), steps.size / 256) < Z_MAX
    a, b = steps[:-1].ravel(), steps[1:].ravel()
    for shift in (0, 12):
        assert joint_z(a, b, shift=shift) < Z_MAX, shift
