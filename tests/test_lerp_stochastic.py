"""fused_ema.lerp_stochastic_: bit for bit the NumPy reference (sr_reference.py) for every
stochastically rounded dtype pair and CPU instruction set; independent of threads, list order and
sharding; float32/float64 EMAs get the plain lerp_; unbiased where round-to-nearest stalls; bad
input refused with nothing written; a dispatcher citizen (opcheck, torch.compile)."""

import numpy as np
import pytest
import sr_reference as ref
import torch

import fused_ema
from conftest import pair_id, random_tensor

SR_PAIRS = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]
PLAIN_PAIRS = [p for p in fused_ema.SUPPORTED_DTYPE_PAIRS if p[0] in (torch.float32, torch.float64)]
SIZES = [1, 7, 33, 1023, 200_003]
WEIGHTS = [1e-4, 0.3, 0.5, 0.7, 1.0]
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def make_lists(sizes, pair, seed):
    g = torch.Generator().manual_seed(seed)
    ema = [random_tensor((n,), pair[0], "cpu", g) for n in sizes]
    src = [random_tensor((n,), pair[1], "cpu", g) for n in sizes]
    return ema, src


def expected(ema, src, weight, seed, step, keys, offsets):
    """PyTorch's lerp in float32 (bit for bit the kernels' formula), then the reference rounding."""
    out = []
    for e, s, key, offset in zip(ema, src, keys, offsets):
        r = torch.lerp(e.float(), s.float(), weight)
        bits = ref.stochastic_round(r.numpy(), DTYPE_NAMES[e.dtype], seed, step, key, offset)
        out.append(torch.from_numpy(bits.view(np.int16)).view(e.dtype).reshape(e.shape))
    return out


def assert_bitwise(actual, wanted):
    for i, (a, b) in enumerate(zip(actual, wanted)):
        same = a.view(torch.int16) == b.view(torch.int16) if a.element_size() == 2 else a == b
        assert bool(same.all()), f"tensor {i}: {int((~same).sum())} of {a.numel()} differ"


@pytest.fixture(params=fused_ema.build_info()["cpu_isas_available"])
def cpu_isa(request):
    previous = fused_ema.set_cpu_isa(request.param)
    yield request.param
    fused_ema.set_cpu_isa(previous)


@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("pair", SR_PAIRS, ids=pair_id)
def test_matches_reference_bit_for_bit(pair, weight, cpu_isa):
    ema, src = make_lists(SIZES, pair, seed=1)
    keys = [3, 0, 2**32 - 1, 17, 5]
    offsets = [0, 5, 2**33 + 2, 1, 2**32 * 4 - 8]  # odd, and across blocks of 2**32 pairs
    seed, step = 2**63 + 12345, 2**40 + 77
    want = expected(ema, src, weight, seed, step, keys, offsets)
    fused_ema.lerp_stochastic_(ema, src, weight, seed=seed, step=step, keys=keys, offsets=offsets)
    assert_bitwise(ema, want)


@pytest.mark.parametrize("pair", SR_PAIRS, ids=pair_id)
def test_special_values_match_reference(pair):
    inf, nan = float("inf"), float("nan")
    values = torch.tensor([0.0, -0.0, inf, -inf, nan, 65504.0, -2.2e5, 1e-8, 3e-41, 3e38])
    ema = [torch.zeros(len(values), dtype=pair[0])]
    src = [values.to(pair[1])]
    want = expected(ema, src, 0.3, 0, 0, [0], [0])
    fused_ema.lerp_stochastic_(ema, src, 0.3, seed=0, step=0)
    assert_bitwise(ema, want)


@pytest.mark.parametrize("weight", [0.3, 1.0])
@pytest.mark.parametrize("pair", SR_PAIRS[2:], ids=pair_id)
def test_every_kind_of_value_matches_reference_on_the_vector_path(pair, weight, cpu_isa):
    """Random float32 bit patterns (NaN, inf, float16 overflows, float32 subnormals) in whole
    vector blocks (weight 1 rounds src itself): in the first half with float16 subnormals in every
    block, in the second half with none (the AVX paths round such blocks another way)."""
    g = torch.Generator().manual_seed(6)
    bits = torch.randint(-(2**31), 2**31, (8192,), generator=g, dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    values[1::2] = torch.randn(4096, generator=g) * 10.0 ** torch.randint(-9, 6, (4096,))
    values[:4096:64] = 1e-6  # a float16 subnormal in every block of the first half
    rest = values[4096:]
    rest[(rest != 0) & (rest.abs() < 2**-14)] = 1.5
    rest[::97] = 0.0
    ema, src = [torch.zeros(8192, dtype=pair[0])], [values]
    want = expected(ema, src, weight, 5, 6, [7], [0])
    fused_ema.lerp_stochastic_(ema, src, weight, seed=5, step=6, keys=[7])
    assert_bitwise(ema, want)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_nan_in_any_one_lane_matches_reference(src_dtype, cpu_isa):
    """A single NaN (either sign, quiet or with a payload) in one lane of a vector block, block by
    block through every lane of either half (the AVX paths check a block for NaN once, then round
    it lane by lane): every other element of the block still rounds stochastically."""
    g = torch.Generator().manual_seed(21)
    lanes = 64  # at least two blocks of the widest path (2 x 16 pairs)
    values = torch.randn(lanes * lanes, generator=g)
    nans = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF], dtype=torch.int64)
    positions = torch.arange(lanes) * lanes + torch.arange(lanes)
    values[positions] = nans.repeat(lanes // 4).to(torch.int32).view(torch.float32)
    ema = [torch.randn(lanes * lanes, generator=g).to(torch.bfloat16)]
    src = [values.to(src_dtype)]
    want = expected(ema, src, 0.3, 9, 4, [2], [0])
    fused_ema.lerp_stochastic_(ema, src, 0.3, seed=9, step=4, keys=[2])
    assert_bitwise(ema, want)
    assert int(torch.isnan(ema[0]).sum()) == lanes


@pytest.mark.parametrize("weight", [0.3, 1.0])
def test_float16_subnormals_in_every_lane_match_reference(weight, cpu_isa):
    """Blocks made of float16 subnormals and zeros (the AVX paths round them in float arithmetic
    of their own): random magnitudes from 2**-34 up to the first normal, 2**-14, either sign, with
    float32 subnormals, the exact steps 2**-24 * k and the values next to the first normal."""
    g = torch.Generator().manual_seed(12)
    exponent = torch.empty(8192).uniform_(-34, -14, generator=g)
    values = (2.0**exponent) * (torch.randint(0, 2, (8192,), generator=g) * 2 - 1)
    values[::7] = torch.randint(0, 1024, (1171,), generator=g) * 2.0**-24  # on a step
    values[::11] = 0.0
    values[5::13] = torch.tensor(1e-40)  # a float32 subnormal
    near = torch.tensor(2.0**-14)
    values[3::17] = torch.nextafter(near, torch.tensor(0.0))
    values[4::17] = near
    ema = [torch.randn(8192, generator=g).mul(2.0**-16).to(torch.float16)]
    src = [values]
    want = expected(ema, src, weight, 3, 8, [5], [0])
    fused_ema.lerp_stochastic_(ema, src, weight, seed=3, step=8, keys=[5])
    assert_bitwise(ema, want)


def f32(bits):
    return float(np.array(bits, dtype=np.uint32).view(np.float32))


# Where the AVX paths' float16 conversion toward zero hands a block to the exact integer path: the
# edges of the results it keeps (0x0401 .. 0x7BFE), infinity, NaN (payloads whose bits plus the
# rounding nudge wrap) and float32 subnormals.
FLOAT16_EDGES = [
    0.0,
    -0.0,
    float("inf"),
    -float("inf"),
    float("nan"),
    f32(0x7FFFFFFF),
    f32(0xFFFFFFFF),
    f32(0x7FFFE001),
    f32(0x7F800001),
    65504.0,
    -65504.0,
    65472.0,
    65503.99,
    65519.99,
    65520.0,
    65535.99,
    65536.0,
    -70000.0,
    3e38,
    2.0**-14,
    -(2.0**-14),
    f32(0x387FFFFF),
    f32(0x38800001),
    2.0**-14 + 2.0**-24,
    f32(0x38801FFF),
    2.0**-24,
    3 * 2.0**-26,
    1e-40,
]


@pytest.mark.parametrize("weight", [0.3, 1.0])
def test_float16_edges_in_every_lane_match_reference(weight, cpu_isa):
    """Each of FLOAT16_EDGES in each lane of 64-element blocks otherwise made of plain normals (the
    AVX paths' vectors take 16 or 32 elements): the block takes the exact path and the others do
    not, every lane bit for bit the reference."""
    g = torch.Generator().manual_seed(21)
    edges = torch.tensor(FLOAT16_EDGES, dtype=torch.float32)
    lanes = 64
    values = torch.randn(len(FLOAT16_EDGES) * lanes, lanes, generator=g) * 100.0
    rows = torch.arange(values.shape[0])
    values[rows, rows % lanes] = edges.repeat_interleave(lanes)
    values = values.reshape(-1)
    ema = [torch.randn(values.numel(), generator=g).to(torch.float16)]
    want = expected(ema, [values], weight, 9, 10, [11], [0])
    fused_ema.lerp_stochastic_(ema, [values], weight, seed=9, step=10, keys=[11])
    assert_bitwise(ema, want)


def test_defaults_and_tensor_arguments():
    ema, src = make_lists([1000, 33], (torch.bfloat16, torch.bfloat16), seed=2)
    other = [e.clone() for e in ema]
    fused_ema.lerp_stochastic_(ema, src, 0.25, seed=9, step=4)
    assert_bitwise(ema, expected(other, src, 0.25, 9, 4, [0, 1], [0, 0]))
    weight = torch.tensor(0.25, dtype=torch.float32)
    fused_ema.lerp_stochastic_(other, src, weight, seed=9, step=torch.tensor(4))
    assert_bitwise(ema, other)


@pytest.mark.parametrize("pair", SR_PAIRS[:2], ids=pair_id)
def test_thread_count_does_not_matter(pair):
    ema, src = make_lists([300_001, 5, 70_000], pair, seed=3)
    copy = [e.clone() for e in ema]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fused_ema.lerp_stochastic_(ema, src, 0.01, seed=1, step=2)
        torch.set_num_threads(2)
        fused_ema.lerp_stochastic_(copy, src, 0.01, seed=1, step=2)
    finally:
        torch.set_num_threads(threads)
    assert_bitwise(ema, copy)


def test_list_order_does_not_matter():
    ema, src = make_lists([1000, 7, 40_000], (torch.float16, torch.float16), seed=4)
    keys = [10, 11, 12]
    order = [2, 0, 1]
    shuffled = [ema[i].clone() for i in order]
    fused_ema.lerp_stochastic_(ema, src, 0.3, seed=5, step=6, keys=keys)
    fused_ema.lerp_stochastic_(
        shuffled, [src[i] for i in order], 0.3, seed=5, step=6, keys=[keys[i] for i in order]
    )
    assert_bitwise([ema[i] for i in order], shuffled)


@pytest.mark.parametrize("split", [50_000, 3, 99_999])
def test_shards_with_offsets_equal_the_whole(split):
    (whole,), (src,) = make_lists([100_001], (torch.bfloat16, torch.float32), seed=5)
    halves = [whole[:split].clone(), whole[split:].clone()]
    fused_ema.lerp_stochastic_([whole], [src], 0.1, seed=7, step=8, keys=[4])
    fused_ema.lerp_stochastic_(
        halves, [src[:split], src[split:]], 0.1, seed=7, step=8, keys=[4, 4], offsets=[0, split]
    )
    assert_bitwise([whole], [torch.cat(halves)])


def test_non_contiguous_ema_numbers_elements_row_major():
    (ema,), (src,) = make_lists([24 * 40], (torch.float16, torch.float16), seed=6)
    ema, src = ema.view(24, 40), src.view(24, 40)
    transposed = ema.t().contiguous().t()  # same values, column-major memory
    strided = torch.zeros(24, 80, dtype=torch.float16)[:, ::2]
    strided.copy_(ema)
    for out in (ema, transposed, strided):
        fused_ema.lerp_stochastic_([out], [src], 0.2, seed=1, step=1)
    assert_bitwise([transposed, strided], [ema, ema])


@pytest.mark.parametrize("pair", PLAIN_PAIRS, ids=pair_id)
def test_float32_and_float64_emas_get_plain_lerp(pair):
    ema, src = make_lists([1023, 5], pair, seed=7)
    sr_ema, sr_src = make_lists([1023], (torch.bfloat16, torch.bfloat16), seed=8)
    plain = [e.clone() for e in ema]
    fused_ema.lerp_(plain, src, 0.3)
    fused_ema.lerp_stochastic_(ema + sr_ema, src + sr_src, 0.3, seed=1, step=1)
    assert_bitwise(ema, plain)


def test_zero_weight_leaves_emas_unchanged():
    ema, src = make_lists([1023], (torch.bfloat16, torch.bfloat16), seed=9)
    before = [e.clone() for e in ema]
    fused_ema.lerp_stochastic_(ema, src, 0.0, seed=1, step=1)
    assert_bitwise(ema, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unbiased_where_round_to_nearest_stalls(dtype):
    """2**16 elements at decay 0.9999 for 200 steps: round-to-nearest never moves, stochastic
    rounding tracks the float64 EMA to within 0.1 unit in the last place on average."""
    n, steps, weight = 2**16, 200, 1e-4
    g = torch.Generator().manual_seed(10)
    src = (1.0 + torch.rand(n, generator=g, dtype=torch.float64)).to(dtype)
    start = torch.ones(n, dtype=dtype)
    exact = start.double()
    ema, nearest = start.clone(), start.clone()
    for t in range(steps):
        fused_ema.lerp_stochastic_([ema], [src], weight, seed=11, step=t)
        fused_ema.lerp_([nearest], [src], weight)
        exact += weight * (src.double() - exact)
    ulp = torch.finfo(dtype).eps  # values in [1, 2)
    assert torch.equal(nearest, start)
    drift = float((exact - start.double()).mean()) / ulp
    assert drift > 1.0  # the EMA has moved by more than an ulp on average
    error = float((ema.double() - exact).mean()) / ulp
    assert abs(error) < 0.1, error


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"keys": [0]}, ValueError, r"keys has 1 entries but ema has 2 tensors"),
        ({"offsets": [0, 0, 0]}, ValueError, r"offsets has 3 entries but ema has 2 tensors"),
        ({"keys": [0, -1]}, ValueError, r"keys\[1\] is -1; keys are 32-bit"),
        ({"keys": [0, 2**32]}, ValueError, r"keys\[1\] is 4294967296"),
        ({"offsets": [0, -3]}, ValueError, r"offsets\[1\] is -3"),
        ({"step": torch.tensor(1.0)}, ValueError, r"step must be one int64 element"),
        ({"step": torch.tensor([1, 2])}, ValueError, r"step must be one int64 element"),
        ({"step": True}, TypeError, r"step must be an int"),
        ({"seed": 2**64}, ValueError, r"seed must fit in 64 bits"),
        ({"seed": 1.5}, TypeError, r"seed must be an int"),
        ({"weight": torch.tensor(0.5, dtype=torch.float16)}, ValueError, r"float32 or float64"),
        ({"weight": float("nan")}, ValueError, r"weight must be finite"),
        ({"weight": True}, TypeError, r"weight must be a float"),
        ({"src1": torch.zeros(5, dtype=torch.int32)}, ValueError, r"src\[1\] has dtype int32"),
        ({"src1": torch.zeros(4, dtype=torch.bfloat16)}, ValueError, r"src\[1\] has shape \[4\]"),
        ({"src1": torch.zeros(5, dtype=torch.float64)}, ValueError, r"unsupported dtype pair"),
        # Tuples are read item by item: int() would truncate 1.5 and parse "3".
        ({"keys": (0, 1.5)}, TypeError, r"stochastic_: keys\[1\] must be an int, got float"),
        ({"keys": ("0", 1)}, TypeError, r"keys\[0\] must be an int, got str"),
        ({"offsets": (0, 2.0)}, TypeError, r"offsets\[1\] must be an int, got float"),
        ({"offsets": 7}, TypeError, r"offsets must be a sequence of ints, got int"),
        # Lists too, checked without a Python loop unless an item is wrong.
        ({"keys": [0, True]}, TypeError, r"stochastic_: keys\[1\] must be an int, got bool"),
        ({"keys": [0, 1.0]}, TypeError, r"keys\[1\] must be an int, got float"),
        ({"offsets": [2**63, 0]}, ValueError, r"offsets\[0\] is 9223372036854775808; it must fit"),
        ({"offsets": [0, -(2**63) - 1]}, ValueError, r"offsets\[1\] is -9223372036854775809"),
        # Every message names the function called, lerp_stochastic_.
        ({"weight": float("inf")}, ValueError, r"^fused_ema\.lerp_stochastic_: weight must be"),
        ({"src1": torch.zeros(4, dtype=torch.bfloat16)}, ValueError, r"^fused_ema\.lerp_stoch"),
        ({"weight": 2**1100}, ValueError, r"stochastic_: weight must fit a float32"),
    ],
)
def test_bad_input_raises_and_writes_nothing(kwargs, error, match):
    ema = [torch.ones(3, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bfloat16)]
    src = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)]
    src[1] = kwargs.pop("src1", src[1])
    args = {"seed": 0, "step": 1, "weight": 0.5, **kwargs}
    weight = args.pop("weight")
    with pytest.raises(error, match=match):
        fused_ema.lerp_stochastic_(ema, src, weight, **args)
    assert all(bool((e == 1).all()) for e in ema)
    assert [e._version for e in ema] == [0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["step", "weight"])
def test_a_device_argument_for_another_device_is_refused_before_any_write(where):
    ema = [torch.ones(3, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bfloat16)]
    src = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)]
    args = {"step": torch.tensor(1), "weight": torch.tensor(0.5)}
    args[where] = args[where].cuda()
    weight = args.pop("weight")
    with pytest.raises(RuntimeError, match=rf"{where} is on cuda:0 but ema tensors are on cpu"):
        fused_ema.lerp_stochastic_(ema, src, weight, seed=0, **args)
    assert all(bool((e == 1).all()) for e in ema)
    assert [e._version for e in ema] == [0, 0]


def test_empty_list_is_a_no_op():
    fused_ema.lerp_stochastic_([], [], 0.5, seed=0, step=0)


def test_opcheck():
    ema, src = make_lists([5, 12, 0, 390], (torch.bfloat16, torch.float32), seed=12)
    args = (ema, src, torch.tensor(0.3), torch.tensor(5), 7, [1, 2, 3, 4], [0, 8, 0, 3])
    torch.library.opcheck(torch.ops.fused_ema.lerp_stochastic_.default, args)


def test_compiled_fullgraph_matches_eager():
    torch._dynamo.reset()

    def update(ema, src, weight, step):
        fused_ema.lerp_stochastic_(ema, src, weight, seed=3, step=step)
        return [2 * e for e in ema]

    compiled = torch.compile(update, fullgraph=True)
    ema, src = make_lists([1000, 33], (torch.float16, torch.float16), seed=13)
    eager = [e.clone() for e in ema]
    for t in range(3):
        weight, step = torch.tensor(0.1 * (t + 1)), torch.tensor(t)
        got = compiled(ema, src, weight, step)
        want = update(eager, src, weight, step)
        for a, b in zip(got + ema, want + eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pair", SR_PAIRS, ids=pair_id)
def test_cuda_matches_cpu_bit_for_bit(pair):
    ema, src = make_lists(SIZES, pair, seed=20)
    gpu_ema, gpu_src = [e.cuda() for e in ema], [s.cuda() for s in src]
    keys, offsets = [3, 0, 2**32 - 1, 17, 5], [0, 5, 2**33 + 2, 1, 2**34 - 8]
    fused_ema.lerp_stochastic_(ema, src, 0.3, seed=1, step=2, keys=keys, offsets=offsets)
    weight, step = torch.tensor(0.3, device="cuda"), torch.tensor(2, device="cuda")
    fused_ema.lerp_stochastic_(
        gpu_ema, gpu_src, weight, seed=1, step=step, keys=keys, offsets=offsets
    )
    assert_bitwise(ema, [e.cpu() for e in gpu_ema])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_read_the_step_on_the_device():
    (ema,), (src,) = make_lists([100_003], (torch.bfloat16, torch.bfloat16), seed=21)
    eager = ema.clone()
    ema, src = ema.cuda(), src.cuda()
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    weight = torch.tensor(1e-3, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up off the capture, as CUDA graphs require
        fused_ema.lerp_stochastic_([ema.clone()], [src], weight, seed=4, step=step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_ema.lerp_stochastic_([ema], [src], weight, seed=4, step=step)
        step.add_(1)
    for t in range(3):
        graph.replay()
        fused_ema.lerp_stochastic_([eager], [src.cpu()], 1e-3, seed=4, step=t)
    torch.cuda.synchronize()
    assert_bitwise([eager], [ema.cpu()])


def test_dtensor_shards_number_their_elements_in_the_full_tensor():
    """Two ranks of an uneven Shard(0) DTensor (rows 0-3 and 4-6 of 7), run one after the other
    on a fake process group, together equal the whole tensor updated at once."""
    dist = pytest.importorskip("torch.distributed")
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    (full_ema,), (full_src,) = make_lists([21], (torch.bfloat16, torch.bfloat16), seed=22)
    full_ema, full_src = full_ema.view(7, 3), full_src.view(7, 3)
    whole = full_ema.clone()
    fused_ema.lerp_stochastic_([whole], [full_src], 0.1, seed=1, step=2, keys=[5])

    def sharded(t, mesh, placement, shape):
        return tensor_api.DTensor.from_local(
            t, mesh, [placement], run_check=False, shape=shape, stride=(shape[1], 1)
        )

    pieces = []
    for rank, rows in enumerate([slice(0, 4), slice(4, 7)]):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,))
            ema, src = full_ema[rows].clone(), full_src[rows].clone()
            rows_ema, rows_src = (sharded(t, mesh, tensor_api.Shard(0), (7, 3)) for t in (ema, src))
            fused_ema.lerp_stochastic_([rows_ema], [rows_src], 0.1, seed=1, step=2, keys=[5])
            pieces.append(ema)
            cols_ema, cols_src = (
                sharded(t.t().contiguous(), mesh, tensor_api.Shard(1), (3, 7)) for t in (ema, src)
            )
            with pytest.raises(ValueError, match=r"needs Shard\(0\)"):
                fused_ema.lerp_stochastic_([cols_ema], [cols_src], 0.1, seed=1, step=2)
        finally:
            dist.destroy_process_group()
    assert_bitwise([torch.cat(pieces)], [whole])
