"""fused_ema.bema_: the fused BEMA update (EMA, snapshot theta0, corrected weights out) against
an independent float64 reference on fresh random data, ema and theta0 bit for bit what lerp_
writes, for every dtype pair, every combination of zero and nonzero weights (the reset w0 = beta =
1, alpha > 1), weights as floats and float32/float64 tensors, long lists of odd sizes, views with
storage offsets, every CPU instruction set alike; every bad input refused with nothing written; a
dispatcher citizen (opcheck, torch.compile(fullgraph=True))."""

import itertools

import pytest
import torch

import fused_ema
from conftest import DTYPE_PAIRS, pair_id, random_tensor

BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SHAPES = [(0,), (1,), (3,), (17,), (4099,), (70000,), (2, 3, 65)]
LISTS = ("ema", "theta0", "out")
OP = torch.ops.fused_ema
# (beta, w0, alpha): every one zero or not, bases on both sides of 0.5, alpha > 1, the reset.
WEIGHTS = [
    *itertools.product((0.0, 0.9), (0.0, 0.3, 1.0), (0.0, 0.6, 2.5)),
    (1.0, 1.0, 0.0),
    (1.0, 1.0, 1.3),
    (0.25, 0.75, -0.5),
]
WEIGHT_KINDS = ["floats", "float32", "float64"]


def weight_id(weights):
    return "b{}-w{}-a{}".format(*weights)


def make_lists(pair, shapes, device, seed):
    """ema, theta0, out (the EMA dtype) and src (the src dtype) of fresh random data."""
    g = torch.Generator().manual_seed(seed)
    src = [random_tensor(sh, pair[1], device, g) for sh in shapes]
    targets = [[random_tensor(sh, pair[0], device, g) for sh in shapes] for _ in LISTS]
    return targets, src


def clone(lists):
    return [[t.clone() for t in tensors] for tensors in lists]


def same_bits(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool((a.view(BITS[a.element_size()]) == b.view(BITS[b.element_size()])).all())
    )


def assert_bits(got, want, what=LISTS):
    for name, a_list, b_list in zip(what, got, want):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            assert same_bits(a, b), f"{name}[{i}] differs"


def as_weights(values, kind, device):
    """(beta, w0, alpha) as the kind of argument the test passes, and as the values the kernels
    see (a float32 tensor's values rounded to float32)."""
    if kind == "floats":
        return list(values), list(values)
    dtype = torch.float32 if kind == "float32" else torch.float64
    t = torch.tensor(values, dtype=dtype, device=device)
    return t, [float(v) for v in t.cpu()]


def lerp_weight(weights, k):
    """weights[k] as lerp_ takes it: a float, or a 0-dim tensor of the same dtype."""
    return weights[k] if isinstance(weights, list) else weights[k].clone()


def f64(t):
    return t.detach().to("cpu", torch.float64)


def assert_close(got, want, scale, dtype, what):
    """|got - want| within a few roundings of the EMA dtype of `scale`."""
    info = torch.finfo(dtype)
    bound = 4 * info.eps * scale + info.tiny
    err = (f64(got) - want).abs()
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements off"


def check_against_reference(before, after, src, values):
    """ema and theta0 from the inputs, out from the stored new ema and theta0, all in float64."""
    beta, w0, alpha = values
    for i, s in enumerate(src):
        x = f64(s)
        for k, w in ((0, beta), (1, w0)):
            b = f64(before[k][i])
            if w == 0.0:
                assert same_bits(after[k][i], before[k][i]), f"{LISTS[k]}[{i}] was written"
            else:
                ref = b + w * (x - b)
                assert_close(after[k][i], ref, b.abs() + x.abs(), after[k][i].dtype, LISTS[k])
        if alpha == 0.0:
            assert same_bits(after[2][i], before[2][i]), f"out[{i}] was written"
        else:
            e, t = f64(after[0][i]), f64(after[1][i])
            # alpha as the kernel rounds it (float for 16/32-bit EMAs).
            a = alpha if src[i].dtype == torch.float64 else float(torch.tensor(alpha).float())
            ref = e + a * (x - t)
            scale = e.abs() + abs(a) * (x.abs() + t.abs())
            assert_close(after[2][i], ref, scale, after[2][i].dtype, f"out[{i}]")


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("values", WEIGHTS, ids=weight_id)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_matches_reference_and_lerp(device, pair, values, kind):
    targets, src = make_lists(pair, SHAPES, device, seed=1)
    before = clone(targets)
    weights, seen = as_weights(values, kind, device)
    fused_ema.bema_(*targets, src, weights)
    check_against_reference(before, targets, src, seen)
    # ema and theta0 bit for bit what lerp_ writes (a weight of 0: untouched, as above).
    for k in (0, 1):
        if seen[k] != 0.0:
            want = [t.clone() for t in before[k]]
            fused_ema.lerp_(want, src, lerp_weight(weights, k))
            assert_bits([targets[k]], [want], [LISTS[k]])


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_reset_copies_src(device, pair):
    """w0 = beta = 1: ema and theta0 become src (rounded to the EMA dtype), out = ema exactly."""
    targets, src = make_lists(pair, [(33,), (4099,)], device, seed=2)
    fused_ema.bema_(*targets, src, [1.0, 1.0, 0.7])
    for i, s in enumerate(src):
        want = s.to(pair[0])
        assert same_bits(targets[0][i], want) and same_bits(targets[1][i], want)
        assert same_bits(targets[2][i], want)


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_many_tensors_equal_one_call_each(device, pair):
    """One call over a long list of odd sizes equals one call per tensor, bit for bit."""
    shapes = [(n,) for n in [0, 1, 3, 17, 4099, 70000, 5, 0, 31, 1024, 1025, 9] * 6]
    targets, src = make_lists(pair, shapes, device, seed=3)
    each = clone(targets)
    fused_ema.bema_(*targets, src, (0.95, 0.1, 1.7))
    for i in range(len(src)):
        fused_ema.bema_([each[0][i]], [each[1][i]], [each[2][i]], [src[i]], (0.95, 0.1, 1.7))
    assert_bits(targets, each)


def offset_views(pair, device, seed, offsets, n=1000):
    """ema, theta0, out, src as views of n elements that start `offsets` elements into buffers
    (every misalignment), with room after; and the buffers."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [pair[0]] * 3 + [pair[1]]
    bufs = [random_tensor((n + 24,), dt, device, g) for dt in dtypes]
    return bufs, [buf[o : o + n] for buf, o in zip(bufs, offsets)]


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_views_with_storage_offsets(device, pair):
    """Views misaligned alike and each its own way equal the same update of contiguous copies,
    and nothing outside the views moves."""
    cases = [(0, 0, 0, 0), (1, 1, 1, 1), (3, 0, 5, 7), (0, 2, 1, 3), (7, 7, 7, 0)]
    cases = [(o, 1000) for o in cases] + [((0, 0, 16, 0), 200_003), ((1, 1, 0, 1), 200_003)]
    for offsets, n in cases:
        bufs, views = offset_views(pair, device, seed=sum(offsets), offsets=offsets, n=n)
        copies = [v.clone() for v in views]
        before = [b.clone() for b in bufs]
        fused_ema.bema_([views[0]], [views[1]], [views[2]], [views[3]], [0.8, 0.4, 1.5])
        fused_ema.bema_([copies[0]], [copies[1]], [copies[2]], [copies[3]], [0.8, 0.4, 1.5])
        assert_bits([[v] for v in views[:3]], [[c] for c in copies[:3]])
        for buf, old, o in zip(bufs, before, offsets):
            assert same_bits(buf[:o], old[:o]) and same_bits(buf[o + n :], old[o + n :])


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_non_contiguous_layouts(device, pair):
    """Transposed, strided and permuted views (computed through stand-ins) equal the same update of
    contiguous copies; each list may have its own layout."""
    g = torch.Generator().manual_seed(4)

    def layouts(dtype):
        return [
            random_tensor((10, 6), dtype, device, g).t(),  # transposed
            random_tensor((6, 10), dtype, device, g),  # contiguous
            random_tensor((6, 20), dtype, device, g)[:, ::2],  # strided slice: gaps
            random_tensor((80,), dtype, device, g)[7:67].view(6, 10),  # storage offset
        ]

    lists = [layouts(pair[0]) for _ in LISTS]
    # Every list takes its layouts in another order: a tensor's four views differ in layout.
    targets = [[lists[k][(i + k) % 4] for i in range(4)] for k in range(3)]
    src = [layouts(pair[1])[(i + 3) % 4] for i in range(4)]
    copies = [[t.contiguous().clone() for t in tensors] for tensors in targets]
    fused_ema.bema_(
        *targets, src, torch.tensor([0.3, 0.6, 2.0], dtype=torch.float64, device=device)
    )
    fused_ema.bema_(*copies, [s.contiguous() for s in src], [0.3, 0.6, 2.0])
    assert_bits([[t.contiguous() for t in tensors] for tensors in targets], copies)


@pytest.fixture
def restore_cpu_isa():
    previous = fused_ema.cpu_isa()
    yield
    fused_ema.set_cpu_isa(previous)


@pytest.mark.parametrize("values", [(0.9, 0.3, 2.5), (0.0, 1.0, 0.6), (0.3, 0.0, 0.0)], ids=str)
def test_every_cpu_isa_gives_the_same_bits(restore_cpu_isa, values):
    """The scalar baseline and each vector instruction set (vector body and scalar tail) agree bit
    for bit, misaligned views included; 200,003 elements take the streaming stores of a float32
    out where it is 64-byte aligned (offset 0 or 16), and the plain ones elsewhere."""
    isas = fused_ema.build_info()["cpu_isas_available"]
    for pair in DTYPE_PAIRS:
        results = {}
        for isa in isas:
            fused_ema.set_cpu_isa(isa)
            got = []
            for offsets in [(0, 0, 0, 0), (1, 3, 5, 2), (1, 3, 16, 2)]:
                for n in (1, 15, 16, 33, 257, 4099, 200_003):
                    _, views = offset_views(pair, "cpu", seed=n, offsets=offsets, n=n)
                    fused_ema.bema_([views[0]], [views[1]], [views[2]], [views[3]], values)
                    got.append(views[:3])
            results[isa] = got
        for isa in isas[1:]:
            for a, b in zip(results[isas[0]], results[isa]):
                assert_bits([[t] for t in a], [[t] for t in b])


def test_tuples_and_version_counters(device):
    targets, src = make_lists(DTYPE_PAIRS[0], [(5,), (0,), (7,)], device, seed=5)
    versions = [[t._version for t in tensors] for tensors in targets]
    fused_ema.bema_(*(tuple(t) for t in targets), tuple(src), (0.5, 0.5, 0.5))
    assert [[t._version for t in tensors] for tensors in targets] == [
        [v + 1 for v in vs] for vs in versions
    ]


def test_empty_lists_and_zero_weights_are_a_no_op(device):
    fused_ema.bema_([], [], [], [], [0.1, 0.2, 0.3])
    fused_ema.bema_([], [], [], [], torch.tensor([0.1, 0.2, 0.3], device=device))
    targets, src = make_lists(DTYPE_PAIRS[1], [(5,), (70000,)], device, seed=6)
    before = clone(targets)
    for weights in ([0.0, 0.0, 0.0], torch.zeros(3, device=device)):
        fused_ema.bema_(*targets, src, weights)
        assert_bits(targets, before)


def test_strided_weights_tensor(device):
    """A 1-D weights tensor with a stride: each weight read at its own place."""
    targets, src = make_lists((torch.float64, torch.float64), [(9,), (300,)], device, seed=7)
    want = clone(targets)
    weights = torch.tensor([0.6, -1.0, 0.2, -1.0, 1.5, -1.0], dtype=torch.float64, device=device)
    fused_ema.bema_(*targets, src, weights[::2])
    fused_ema.bema_(*want, src, [0.6, 0.2, 1.5])
    assert_bits(targets, want)


def test_cpu_weights_serve_any_device(device):
    targets, src = make_lists((torch.float32, torch.bfloat16), [(9,), (300,)], device, seed=8)
    want = clone(targets)
    fused_ema.bema_(*targets, src, torch.tensor([0.6, 0.2, 1.5], dtype=torch.float64))
    fused_ema.bema_(*want, src, [0.6, 0.2, 1.5])
    assert_bits(targets, want)


# Errors: nothing written, no version counter moved.


def good_lists(device, count=5, n=257):
    return make_lists((torch.float32, torch.float32), [(n,)] * count, device, seed=40)


def assert_rejected(call, tensors, error, match):
    """call() raises `error` matching `match`; every tensor keeps its bits and version."""
    tensors = [t for t in tensors if t.device.type != "meta"]
    snapshot = [t.detach().clone() for t in tensors]
    versions = [None if t.is_inference() else t._version for t in tensors]
    with pytest.raises(error, match=match):
        call()
    for t, s in zip(tensors, snapshot):
        assert torch.equal(t, s), "a tensor changed although the call was rejected"
    assert [None if t.is_inference() else t._version for t in tensors] == versions


def raw(ema, theta0, out, src, weights):
    """The dispatcher entry."""
    if not isinstance(weights, torch.Tensor):
        weights = torch.tensor(weights, dtype=torch.float64)
    OP.bema_(list(ema), list(theta0), list(out), list(src), weights)


@pytest.fixture(params=["api", "raw"])
def entry(request):
    return {"api": fused_ema.bema_, "raw": raw}[request.param]


def everything(targets, src):
    return [t for tensors in targets for t in tensors] + list(src)


def replaced(targets, k, i, tensor):
    lists = clone_refs(targets)
    lists[k][i] = tensor
    return lists


def clone_refs(targets):
    return [list(tensors) for tensors in targets]


@pytest.mark.parametrize("k", [0, 1, 2], ids=LISTS)
def test_list_of_another_length(entry, device, k):
    targets, src = good_lists(device)
    lists = clone_refs(targets)
    lists[k] = lists[k][:4]
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(targets, src),
        ValueError,
        rf"fused_ema.bema_: {LISTS[k]} has 4 tensors but src has 5",
    )


@pytest.mark.parametrize("k", [1, 2], ids=LISTS[1:])
def test_target_of_another_dtype(entry, device, k):
    targets, src = good_lists(device)
    lists = replaced(targets, k, 3, targets[k][3].half())
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(lists, src),
        ValueError,
        rf"fused_ema.bema_: {LISTS[k]}\[3\] is float16 but ema\[3\] is float32",
    )


def test_unsupported_dtype_pair(entry, device):
    targets, src = good_lists(device)
    lists = [replaced_list(t, 3, t[3].half()) for t in targets]
    src = replaced_list(src, 3, src[3].bfloat16())
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(lists, src),
        ValueError,
        r"fused_ema.bema_: unsupported dtype pair at ema\[3\]",
    )


def replaced_list(tensors, i, tensor):
    tensors = list(tensors)
    tensors[i] = tensor
    return tensors


def test_integer_targets(entry, device):
    targets, src = good_lists(device)
    lists = [
        replaced_list(t, 2, torch.ones(257, dtype=torch.int32, device=device)) for t in targets
    ]
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(lists, src),
        (ValueError, RuntimeError),
        r"fused_ema.bema_: ",
    )


@pytest.mark.parametrize("k", [0, 1, 2], ids=LISTS)
def test_shape_mismatch(entry, device, k):
    targets, src = good_lists(device)
    lists = replaced(targets, k, 3, targets[k][3][:256])
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(targets, src),
        ValueError,
        rf"src\[3\] has shape \[257\] but {LISTS[k]}\[3\] has shape \[256\]",
    )


@pytest.mark.parametrize(
    "case, match",
    [
        ("theta0 is ema", r"ema\[2\] and theta0\[2\] share memory"),
        ("out overlaps ema of another tensor", r"ema\[1\] and out\[3\] share memory"),
        ("out is src", r"src\[4\] aliases out\[4\]"),
        ("theta0 overlaps another src", r"src\[0\] shares memory with theta0\[1\]"),
    ],
)
def test_overlapping_memory(entry, device, case, match):
    targets, src = good_lists(device)
    lists = clone_refs(targets)
    if case == "theta0 is ema":
        lists[1][2] = lists[0][2]
    elif case == "out overlaps ema of another tensor":
        buf = torch.randn(400, device=device)
        lists[0][1], lists[2][3] = buf[:257], buf[100:357]
    elif case == "out is src":
        lists[2][4] = src[4]
    else:
        buf = torch.randn(400, device=device)
        src = replaced_list(src, 0, buf[:257])
        lists[1][1] = buf[50:307]
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(lists, src),
        RuntimeError,
        match,
    )


def test_internally_overlapping_target(entry, device):
    targets, src = good_lists(device)
    lists = replaced(targets, 2, 1, torch.randn(1, device=device).expand(257))
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(targets, src),
        RuntimeError,
        r"out\[1\] has internally overlapping memory",
    )


def test_sparse_target(entry, device):
    targets, src = good_lists(device)
    lists = replaced(targets, 1, 0, targets[1][0].to_sparse())
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(targets, src),
        (ValueError, RuntimeError, NotImplementedError),
        r"dense|sparse|Sparse",
    )


def test_target_requiring_grad_under_grad_mode(entry, device):
    targets, src = good_lists(device)
    lists = replaced(targets, 1, 2, targets[1][2].clone().requires_grad_())
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(targets, src),
        RuntimeError,
        r"theta0\[2\] requires grad",
    )


def test_inference_tensor_outside_inference_mode(entry, device):
    targets, src = good_lists(device)
    with torch.inference_mode():
        frozen = targets[2][4].clone()
    lists = replaced(targets, 2, 4, frozen)
    assert_rejected(
        lambda: entry(*lists, src, [0.1, 0.2, 0.3]),
        everything(targets, src) + [frozen],
        RuntimeError,
        r"out\[4\] is an inference tensor",
    )


META = "meta tensors hold no data"


def test_meta_tensors(entry):
    lists = [[torch.empty(5, device="meta")] for _ in LISTS]
    with pytest.raises(RuntimeError, match=META):
        entry(*lists, [torch.empty(5, device="meta")], [0.1, 0.2, 0.3])
    targets, src = good_lists("cpu")
    weights = torch.tensor([0.1, 0.2, 0.3], device="meta")
    assert_rejected(
        lambda: entry(*targets, src, weights), everything(targets, src), RuntimeError, META
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_devices_must_match():
    targets, src = good_lists("cpu")
    lists = replaced(targets, 1, 3, targets[1][3].cuda())
    assert_rejected(
        lambda: fused_ema.bema_(*lists, src, [0.1, 0.2, 0.3]),
        everything(targets, src),
        RuntimeError,
        r"src\[3\] is on cpu but theta0\[3\] is on cuda",
    )
    assert_rejected(
        lambda: fused_ema.bema_(*targets, src, torch.tensor([0.1, 0.2, 0.3], device="cuda")),
        everything(targets, src),
        RuntimeError,
        r"weights is on cuda:0 but EMA tensors are on cpu",
    )


@pytest.mark.parametrize(
    "weights, error, match",
    [
        ([0.1, 0.2], ValueError, r"weights must be 3 floats|1-D tensor of 3 elements"),
        ([0.1, 0.2, 0.3, 0.4], ValueError, r"weights must be 3 floats|1-D tensor of 3 elements"),
        ([0.1, float("nan"), 0.3], ValueError, r"weights\[1\] \(w0\) must be finite"),
        ([0.1, 0.2, float("inf")], ValueError, r"weights\[2\] \(alpha\) must be finite"),
        (torch.tensor([0.1, 0.2]), ValueError, r"1-D tensor of 3 elements"),
        (torch.tensor([[0.1, 0.2, 0.3]]), ValueError, r"1-D tensor of 3 elements"),
        (torch.tensor([1, 0, 1]), ValueError, r"weights must be float32 or float64, got int64"),
        (torch.tensor([0.1, 0.2, 0.3], dtype=torch.float16), ValueError, r"float32 or float64"),
    ],
)
def test_bad_weights(entry, device, weights, error, match):
    targets, src = good_lists(device)
    assert_rejected(lambda: entry(*targets, src, weights), everything(targets, src), error, match)


@pytest.mark.parametrize("weights", ["abc", 0.5, [0.1, True, 0.3], [0.1, "x", 0.3], None])
def test_weights_of_another_type(device, weights):
    targets, src = good_lists(device)
    assert_rejected(
        lambda: fused_ema.bema_(*targets, src, weights),
        everything(targets, src),
        TypeError,
        r"fused_ema.bema_: weights",
    )


def test_weights_requiring_grad(entry, device):
    targets, src = good_lists(device)
    weights = torch.tensor([0.1, 0.2, 0.3], device=device, requires_grad=True)
    assert_rejected(
        lambda: entry(*targets, src, weights),
        everything(targets, src),
        RuntimeError,
        r"weights requires grad",
    )


def test_a_tensor_instead_of_a_list(device):
    targets, src = good_lists(device)
    with pytest.raises(TypeError, match=r"fused_ema.bema_: theta0 must be a sequence"):
        fused_ema.bema_(targets[0], targets[1][0], targets[2], src, [0.1, 0.2, 0.3])


# The dispatcher: opcheck and torch.compile.


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_opcheck(device, pair):
    targets, src = make_lists(pair, [(5,), (3, 4), (0,), (2, 3, 65)], device, seed=50)
    for dtype in (torch.float32, torch.float64):
        for values in ([0.3, 0.8, 1.5], [0.0, 1.0, 0.0]):
            weights = torch.tensor(values, dtype=dtype, device=device)
            torch.library.opcheck(OP.bema_.default, (*targets, src, weights))


def test_opcheck_non_contiguous(device):
    g = torch.Generator().manual_seed(51)
    targets = [[random_tensor((8, 6), torch.float32, device, g).t()] for _ in LISTS]
    src = [random_tensor((8, 12), torch.float32, device, g)[:, ::2].t()]
    torch.library.opcheck(OP.bema_.default, (*targets, src, torch.tensor([0.6, 0.1, 2.0])))


@pytest.mark.parametrize("weight_kind", ["floats", "tensor"])
def test_compiled_fullgraph_matches_eager(device, weight_kind):
    torch._dynamo.reset()

    def step(ema, theta0, out, src, weights):
        fused_ema.bema_(ema, theta0, out, src, weights)
        return [2 * t for t in out]  # exact: outputs agree bit for bit

    compiled = torch.compile(step, fullgraph=True)
    pair = (torch.float32, torch.bfloat16)
    targets, src = make_lists(pair, [(5,), (3, 4), (0,), (2, 3, 65)], device, seed=52)
    eager = clone(targets)
    for t in range(3):
        values = [0.9 + 0.01 * t, 1.0 if t == 0 else 0.0, 0.5 * (t + 1)]
        weights = values if weight_kind == "floats" else torch.tensor(values, device=device)
        got = compiled(*targets, src, weights)
        want = step(*eager, src, weights)
        assert_bits([got, *targets], [want, *eager], ("returned", *LISTS))


def test_compiled_rejects_bad_input_at_trace_time():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def step(ema, theta0, out, src):
        fused_ema.bema_(ema, theta0, out, src, [0.5, 0.5, 0.5])

    targets, src = good_lists("cpu", count=2)
    lists = replaced(targets, 1, 1, targets[1][1].double())
    with pytest.raises(Exception, match=r"theta0\[1\] is float64 but ema\[1\] is float32"):
        step(*lists, src)
    for t, want in zip(everything(targets, src), everything(*good_lists("cpu", count=2))):
        assert torch.equal(t, want)


def test_fake_tensors_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lists = [[torch.empty(5), torch.empty(2, 3)] for _ in LISTS]
        src = [torch.empty(5, dtype=torch.bfloat16), torch.empty(2, 3, dtype=torch.bfloat16)]
        OP.bema_(*lists, src, torch.tensor([0.1, 0.2, 0.3]))
        lists[2][1] = torch.empty(3, 2)
        with pytest.raises(ValueError, match=r"src\[1\] has shape \[2, 3\] but out\[1\]"):
            OP.bema_(*lists, src, torch.tensor([0.1, 0.2, 0.3]))


def test_dtensor_shards():
    """An uneven Shard(0) DTensor on a fake 2-rank group, each rank in turn: each rank's update of
    its shards equals the same rows of the whole tensors' update, bit for bit."""
    dist = pytest.importorskip("torch.distributed")
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    targets, src = make_lists((torch.float32, torch.bfloat16), [(7, 3)], "cpu", seed=33)
    whole = clone(targets)
    fused_ema.bema_(*whole, src, [0.9, 0.2, 1.5])
    for rank, rows in enumerate([slice(0, 4), slice(4, 7)]):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,))

            def shard(t, mesh=mesh):
                return tensor_api.DTensor.from_local(
                    t, mesh, [tensor_api.Shard(0)], run_check=False, shape=(7, 3), stride=(3, 1)
                )

            local = [tensors[0][rows].clone() for tensors in targets]
            fused_ema.bema_(*([shard(t)] for t in local), [shard(src[0][rows])], [0.9, 0.2, 1.5])
            assert_bits([[t] for t in local], [[tensors[0][rows]] for tensors in whole])
        finally:
            dist.destroy_process_group()
