"""fused_ema.lerp_ computes the right values: against a float64 reference on every device and
dtype pair, bit for bit against torch._foreach_lerp_ on the CPU, across sizes, alignments,
layouts, list lengths, weights and CPU instruction sets."""

import pytest
import torch

import fused_ema
from conftest import (
    DTYPE_PAIRS,
    SAME_DTYPE_PAIRS,
    assert_lerp_close,
    pair_id,
    random_tensor,
)

SIZES = [0, 1, 7, 33, 1023, 200_003]  # empty, tiny, odd, beyond one CPU grain and CUDA chunk
WEIGHTS = [0.0, 1.0, 0.5, 0.5 - 1e-7, 0.5 + 1e-7, 1e-4, 0.3, 0.9]


def make_lists(sizes, pair, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ema = [random_tensor((n,), pair[0], device, g) for n in sizes]
    src = [random_tensor((n,), pair[1], device, g) for n in sizes]
    return ema, src


def foreach_expected(ema, src, weight):
    """torch._foreach_lerp_ on copies in each pair's wider dtype: a 16-bit src is upcast first
    (exact); a 16-bit EMA of a float32 src is computed in float32 (the kernels' opmath), then
    rounded to nearest once."""
    wide = [torch.promote_types(e.dtype, s.dtype) for e, s in zip(ema, src)]
    out = [e.to(w, copy=True) for e, w in zip(ema, wide)]
    torch._foreach_lerp_(out, [s.to(w) for s, w in zip(src, wide)], weight)
    return [o.to(e.dtype) for o, e in zip(out, ema)]


def assert_bitwise(actual, expected):
    for i, (a, b) in enumerate(zip(actual, expected)):
        same = (a == b) | (a.isnan() & b.isnan())
        assert bool(same.all()), f"tensor {i}: {int((~same).sum())} elements differ"


@pytest.mark.parametrize("weight", WEIGHTS)
def test_matches_float64_reference(device, dtype_pair, weight):
    ema, src = make_lists(SIZES, dtype_pair, device)
    before = [e.clone() for e in ema]
    fused_ema.lerp_(ema, src, weight)
    for e, b, s in zip(ema, before, src):
        assert e.dtype == dtype_pair[0] and e.device.type == device
        assert_lerp_close(e, b, s, weight)


@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_cpu_bitwise_equal_to_foreach_lerp(pair, weight):
    # Mixed pairs compare against foreach in the wider dtype (see foreach_expected).
    ema, src = make_lists(SIZES, pair, "cpu", seed=1)
    expected = foreach_expected(ema, src, weight)
    fused_ema.lerp_(ema, src, weight)
    assert_bitwise(ema, expected)


def test_weight_zero_and_one_are_exact(device, dtype_pair):
    ema, src = make_lists([1023, 5], dtype_pair, device, seed=2)
    before = [e.clone() for e in ema]
    fused_ema.lerp_(ema, src, 0.0)
    assert_bitwise(ema, before)
    fused_ema.lerp_(ema, src, 1.0)
    assert_bitwise(ema, [s.to(e.dtype) for e, s in zip(ema, src)])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64])
def test_tensor_weight_equals_float_weight(device, dtype_pair, weight_dtype):
    weight = torch.tensor(0.37, dtype=weight_dtype, device=device)
    ema, src = make_lists([1, 1023, 200_003], dtype_pair, device, seed=3)
    expected = [e.clone() for e in ema]
    fused_ema.lerp_(expected, src, float(weight))
    fused_ema.lerp_(ema, src, weight)
    assert_bitwise(ema, expected)


def test_cpu_tensor_weight_serves_any_device(device):
    ema, src = make_lists([100], (torch.float32, torch.float32), device, seed=4)
    expected = [e.clone() for e in ema]
    fused_ema.lerp_(expected, src, 0.25)
    fused_ema.lerp_(ema, src, torch.tensor(0.25))
    assert_bitwise(ema, expected)


@pytest.mark.parametrize("offsets", [(1, 1), (3, 3), (1, 0), (0, 5)], ids=str)
def test_misaligned_views(device, dtype_pair, offsets):
    # Equal offsets keep the vector path after a scalar head; unequal ones force the plain path.
    n = 4099
    g = torch.Generator().manual_seed(5)
    ema_base = random_tensor((n + 8,), dtype_pair[0], device, g)
    src_base = random_tensor((n + 8,), dtype_pair[1], device, g)
    ema = ema_base[offsets[0] : offsets[0] + n]
    src = src_base[offsets[1] : offsets[1] + n]
    untouched = torch.cat([ema_base[: offsets[0]], ema_base[offsets[0] + n :]]).clone()
    before = ema.clone()
    fused_ema.lerp_([ema], [src], 0.1)
    assert_lerp_close(ema, before, src, 0.1)
    assert torch.equal(torch.cat([ema_base[: offsets[0]], ema_base[offsets[0] + n :]]), untouched)


def test_non_contiguous_ema_and_src(device, dtype_pair):
    g = torch.Generator().manual_seed(6)
    ema_base = random_tensor((64, 34), dtype_pair[0], device, g)
    src_base = random_tensor((34, 64), dtype_pair[1], device, g)
    cases = [
        (ema_base.t(), src_base),  # permuted (dense) ema, contiguous src
        (ema_base[:, ::2], src_base.t()[:, 1::2]),  # ema with gaps, strided src
        (ema_base[:, 1:33], src_base[1:33].t()),  # offset slice with gaps, permuted src
    ]
    for k, (ema, src) in enumerate(cases):
        snapshot = ema_base.clone()
        before = ema.clone()
        fused_ema.lerp_([ema], [src], 0.2)
        assert_lerp_close(ema, before, src, 0.2)
        # Elements outside the view are untouched (written back only where the view lies).
        mask = torch.ones_like(ema_base, dtype=torch.bool)
        mask_view = {0: mask.t(), 1: mask[:, ::2], 2: mask[:, 1:33]}[k]
        mask_view.fill_(False)
        assert torch.equal(ema_base[mask], snapshot[mask]), f"case {k} wrote outside its view"


@pytest.mark.parametrize("count", [1, 5, 10_000])
def test_list_lengths(device, count):
    g = torch.Generator().manual_seed(7)
    sizes = torch.randint(0, 300, (count,), generator=g).tolist()
    ema, src = make_lists(sizes, (torch.float32, torch.float32), device, seed=8)
    before = [e.clone() for e in ema]
    fused_ema.lerp_(ema, src, 0.05)
    for e, b, s in zip(ema, before, src):
        assert_lerp_close(e, b, s, 0.05)
    if device == "cpu":
        assert_bitwise(ema, foreach_expected(before, src, 0.05))


def test_list_mixing_dtype_pairs(device):
    pairs = DTYPE_PAIRS * 3
    g = torch.Generator().manual_seed(9)
    ema = [random_tensor((257 + i,), e, device, g) for i, (e, _) in enumerate(pairs)]
    src = [random_tensor((257 + i,), s, device, g) for i, (_, s) in enumerate(pairs)]
    before = [e.clone() for e in ema]
    fused_ema.lerp_(ema, src, 0.01)
    for e, b, s in zip(ema, before, src):
        assert_lerp_close(e, b, s, 0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_list_spanning_cpu_and_cuda():
    g = torch.Generator().manual_seed(10)
    devices = ["cpu", "cuda", "cuda", "cpu"]
    ema = [random_tensor((1000,), torch.float32, d, g) for d in devices]
    src = [random_tensor((1000,), torch.bfloat16, d, g) for d in devices]
    before = [e.clone() for e in ema]
    fused_ema.lerp_(ema, src, torch.tensor(0.3))
    for e, b, s, d in zip(ema, before, src, devices):
        assert e.device.type == d
        assert_lerp_close(e, b, s, 0.3)


def test_multidimensional_and_scalar_tensors(device, dtype_pair):
    g = torch.Generator().manual_seed(11)
    shapes = [(), (3, 5, 7), (2, 0, 4), (1, 1, 1025)]
    ema = [random_tensor(sh, dtype_pair[0], device, g) for sh in shapes]
    src = [random_tensor(sh, dtype_pair[1], device, g) for sh in shapes]
    before = [e.clone() for e in ema]
    fused_ema.lerp_(ema, src, 0.7)
    for e, b, s in zip(ema, before, src):
        assert e.shape == b.shape
        assert_lerp_close(e, b, s, 0.7)


def test_nan_and_inf_propagate_like_lerp(device):
    ema = torch.tensor([1.0, 2.0, 3.0, 4.0], device=device)
    src = torch.tensor([float("nan"), float("inf"), 5.0, -float("inf")], device=device)
    expected = ema.clone().lerp_(src, 0.1)
    fused_ema.lerp_([ema], [src], 0.1)
    torch.testing.assert_close(ema, expected, equal_nan=True)


def test_accepts_tuples_and_generators(device):
    ema, src = make_lists([10, 20], (torch.float32, torch.float32), device, seed=12)
    expected = foreach_expected(ema, src, 0.5)
    fused_ema.lerp_(tuple(ema), (s for s in src), 0.5)
    for a, b in zip(ema, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bumps_version_counters(device):
    ema, src = make_lists([10, 0], (torch.float32, torch.float32), device, seed=13)
    versions = [e._version for e in ema]
    fused_ema.lerp_(ema, src, 0.5)
    torch.ops.fused_ema.lerp_(ema, src, 0.5)
    assert [e._version for e in ema] == [v + 2 for v in versions]


def test_saved_tensor_modified_is_detected(device):
    # Evaluating with an EMA weight under autograd, then updating it, must not give silently
    # wrong gradients: autograd sees the version change.
    x = torch.randn(4, device=device, requires_grad=True)
    ema_weight = torch.randn(4, device=device)
    loss = (x * ema_weight).sum()
    fused_ema.lerp_([ema_weight], [torch.randn(4, device=device)], 0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_every_cpu_isa_is_bitwise_identical(pair, restore_cpu_isa):
    isas = fused_ema.build_info()["cpu_isas_available"]
    if len(isas) < 2:
        pytest.skip(f"only {isas} runs on this CPU")
    sizes = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 100_003]
    ema, src = make_lists(sizes, pair, "cpu", seed=14)
    results = {}
    for isa in isas:
        fused_ema.set_cpu_isa(isa)
        assert fused_ema.cpu_isa() == isa
        for weight in (1e-3, 0.75):
            out = [e.clone() for e in ema]
            fused_ema.lerp_(out, src, weight)
            results[(isa, weight)] = out
    for (_isa, weight), out in results.items():
        assert_bitwise(out, results[("default", weight)])


# Special values per dtype: every kind of NaN as raw bits (quiet and signalling, either sign, with
# payloads), and infinities, signed zeros, subnormals, values past float16's range, huge values.
NAN_BITS = {
    torch.float64: [0x7FF8000012345678, -0x0007FFFFFFFFFFFF, 0x7FF0000000000001],
    torch.float32: [0x7FC12345, -0x003FFFFF, 0x7F800001, 0x7FFFFFFF],
    torch.bfloat16: [0x7FC1, -0x007F, 0x7F81],
    torch.float16: [0x7E01, -0x0300, 0x7C01],
}
BITS_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16}
SPECIAL_VALUES = [float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 1e-40, 6e-8, 7e4, 65520.0, 3e38]


def with_special_values(t, g):
    """t with a fifth of its elements, at random places, set to NaNs or SPECIAL_VALUES."""
    bits = BITS_DTYPE[t.element_size()]
    nans = torch.tensor(NAN_BITS[t.dtype], dtype=torch.int64).to(bits).view(t.dtype)
    pool = torch.cat([nans, torch.tensor(SPECIAL_VALUES, dtype=torch.float64).to(t.dtype)])
    at = torch.randperm(t.numel(), generator=g)[: t.numel() // 5]
    t = t.clone()
    t[at] = pool[torch.randint(len(pool), (len(at),), generator=g)]
    return t


def as_bits(t):
    return t.view(BITS_DTYPE[t.element_size()])


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_every_cpu_isa_writes_the_same_bits_for_special_values(pair, restore_cpu_isa):
    """NaNs with payloads, infinities, zeros, subnormals and overflows, through lerp_ and bema_
    (vector bodies and scalar tails): every instruction set writes the bits of the baseline. A
    16-bit EMA holds NaN as c10's scalar conversion writes it (bfloat16 0x7FC0, float16
    sign | 0x7E00), whatever the payload; float32/float64 NaNs keep a hardware payload, so for
    them NaN-ness is compared."""
    g = torch.Generator().manual_seed(21)
    sizes = [1, 15, 33, 64, 1000, 4099]
    ema = [with_special_values(random_tensor((n,), pair[0], "cpu", g), g) for n in sizes]
    src = [with_special_values(random_tensor((n,), pair[1], "cpu", g), g) for n in sizes]
    results = {}
    for isa in fused_ema.build_info()["cpu_isas_available"]:
        fused_ema.set_cpu_isa(isa)
        lerped = [e.clone() for e in ema]
        fused_ema.lerp_(lerped, src, 0.3)
        lists = [[e.clone() for e in ema] for _ in range(3)]
        fused_ema.bema_(*lists, src, (0.9, 0.3, 2.5))
        results[isa] = lerped + [t for ts in lists for t in ts]
    sixteen_bit = pair[0] in (torch.bfloat16, torch.float16)
    for isa, out in results.items():
        for i, (a, b) in enumerate(zip(out, results["default"])):
            if sixteen_bit:
                assert torch.equal(as_bits(a), as_bits(b)), f"{isa}: tensor {i}"
            else:
                same = (as_bits(a) == as_bits(b)) | (a.isnan() & b.isnan())
                assert bool(same.all()), f"{isa}: tensor {i}"
        if sixteen_bit:
            nan_bits = torch.cat([as_bits(t)[t.isnan()] for t in out]).int() & 0xFFFF
            assert len(nan_bits) > 0
            if pair[0] == torch.bfloat16:
                assert bool((nan_bits == 0x7FC0).all()), f"{isa}: {nan_bits.unique()}"
            else:
                assert bool(((nan_bits & 0x7FFF) == 0x7E00).all()), f"{isa}: {nan_bits.unique()}"


@pytest.mark.parametrize("ema_dtype", [torch.bfloat16, torch.float16])
def test_one_nan_in_any_lane_rounds_like_c10_on_every_cpu_isa(ema_dtype, restore_cpu_isa):
    """A single NaN from the float32 source in one lane of a vector block, block by block through
    every lane (the AVX paths check two vectors for NaN at once, then convert lane by lane): every
    element is what torch's own lerp in float32 and c10's conversion write, NaN as 0x7FC0
    (bfloat16) or sign | 0x7E00 (float16), the block's other elements rounded to nearest."""
    g = torch.Generator().manual_seed(22)
    lanes = 64  # at least two blocks of the widest path (2 x 16 floats)
    src = torch.randn(lanes * lanes, generator=g)
    nans = torch.tensor([0x7FC12345, -0x003FFFFF, 0x7F800001, 0x7FFFFFFF], dtype=torch.int64)
    at = torch.arange(lanes) * lanes + torch.arange(lanes)
    src[at] = nans.repeat(lanes // 4).to(torch.int32).view(torch.float32)
    ema = torch.randn(lanes * lanes, generator=g).to(ema_dtype)
    want = torch.lerp(ema.float(), src, 0.3).to(ema_dtype)  # NaN: torch's vector conversion's
    nan = torch.zeros(lanes * lanes, dtype=torch.bool)
    nan[at] = True
    for isa in fused_ema.build_info()["cpu_isas_available"]:
        fused_ema.set_cpu_isa(isa)
        out = ema.clone()
        fused_ema.lerp_([out], [src], 0.3)
        assert torch.equal(as_bits(out)[~nan], as_bits(want)[~nan]), isa
        assert torch.equal(out.isnan(), nan), isa
        nan_bits = as_bits(out)[nan].int() & (0xFFFF if ema_dtype == torch.bfloat16 else 0x7FFF)
        assert bool((nan_bits == (0x7FC0 if ema_dtype == torch.bfloat16 else 0x7E00)).all()), isa


@pytest.mark.parametrize("pair", SAME_DTYPE_PAIRS, ids=pair_id)
def test_cpu_isa_paths_match_foreach(pair, restore_cpu_isa):
    ema, src = make_lists([7, 100, 4097], pair, "cpu", seed=15)
    expected = foreach_expected(ema, src, 0.01)
    for isa in fused_ema.build_info()["cpu_isas_available"]:
        fused_ema.set_cpu_isa(isa)
        out = [e.clone() for e in ema]
        fused_ema.lerp_(out, src, 0.01)
        assert_bitwise(out, expected)


def test_set_cpu_isa_rejects_unknown_names(restore_cpu_isa):
    with pytest.raises(ValueError, match="not available"):
        fused_ema.set_cpu_isa("sse9")
