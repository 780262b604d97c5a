"""Property test: for random shapes, layouts, dtype pairs and weights, fused_ema.lerp_ agrees with
a float64 reference, and with torch._foreach_lerp_ bit for bit on the CPU."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fused_ema
from conftest import DEVICES, DTYPE_PAIRS, assert_lerp_close, random_tensor

shapes = st.lists(st.integers(min_value=0, max_value=70), min_size=0, max_size=3).map(tuple)
weights = st.one_of(
    st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
    st.sampled_from([0.0, 1.0, 0.5, 0.5 - 2**-24, 0.5 + 2**-24, 1e-4, 1 - 1e-4]),
)


@st.composite
def lerp_case(draw):
    device = draw(st.sampled_from(DEVICES))
    count = draw(st.integers(min_value=1, max_value=6))
    seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ema, src = [], []
    for _ in range(count):
        pair = draw(st.sampled_from(DTYPE_PAIRS))
        shape = draw(shapes)
        e = random_tensor(shape, pair[0], device, g)
        s = random_tensor(shape, pair[1], device, g)
        if e.dim() >= 2 and draw(st.booleans()):
            e = e.transpose(0, 1).contiguous().transpose(0, 1)  # permuted, dense
        if s.dim() >= 1 and s.shape[-1] > 1 and draw(st.booleans()):
            wide = random_tensor((*shape[:-1], 2 * shape[-1]), pair[1], device, g)
            s = wide[..., ::2]  # strided src
        if draw(st.booleans()):
            padded = random_tensor((e.numel() + 1,), pair[0], device, g)
            e = padded[1:].view(e.shape) if e.is_contiguous() else e  # misaligned ema
        ema.append(e)
        src.append(s)
    return ema, src, draw(weights)


@settings(max_examples=150, deadline=None)
@given(lerp_case())
def test_lerp_matches_references(case):
    ema, src, weight = case
    before = [e.clone() for e in ema]
    fused_ema.lerp_(ema, src, weight)
    for e, b, s in zip(ema, before, src):
        assert e.dtype == b.dtype and e.shape == b.shape
        assert_lerp_close(e, b, s, weight)
        if e.device.type == "cpu":
            # In the pair's wider dtype (the kernels' opmath for a 16-bit EMA of float32).
            wide = torch.promote_types(b.dtype, s.dtype)
            expected = b.to(wide, copy=True).lerp_(s.to(wide), weight).to(b.dtype)
            same = (e == expected) | (e.isnan() & expected.isnan())
            assert bool(same.all())
