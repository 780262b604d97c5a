"""fused_ema.lerp_many_: K EMA tracks of one list of sources in one call, each track bit for bit
what K separate lerp_ (lerp_stochastic_) calls give, on fresh random data, for every dtype pair,
mixed lists, K from 1 to 9, float and tensor weights; torch._foreach_lerp_ for same-dtype pairs;
views of every layout; every bad input refused with nothing written; a dispatcher citizen
(opcheck, torch.compile(fullgraph=True)) and DTensor shards."""

import pytest
import torch

import fused_ema
from conftest import DTYPE_PAIRS, SAME_DTYPE_PAIRS, pair_id, random_tensor

SR_PAIRS = [p for p in DTYPE_PAIRS if p[0] in (torch.bfloat16, torch.float16)]
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Sizes around the CPU kernel's block (4 KB of src), vector widths and element pairs.
SHAPES = [(1,), (7,), (33,), (2, 3, 65), (1023,), (1025,), (2049,), (5000,), (0,), (3, 0)]
WEIGHTS = [0.5, 1.0, 0.0, 1e-30, 0.3, 0.7, 1e-4, 0.9999, 0.25]
OP = torch.ops.fused_ema


def make_tracks(pairs, shapes, device, seed):
    """emas (one list per entry of `pairs`, pair k's EMA dtype) and src (pair 0's src dtype)
    of fresh random data."""
    g = torch.Generator().manual_seed(seed)
    src = [random_tensor(sh, pairs[0][1], device, g) for sh in shapes]
    emas = [[random_tensor(sh, pair[0], device, g) for sh in shapes] for pair in pairs]
    return emas, src


def clone(emas):
    return [[e.clone() for e in track] for track in emas]


def assert_bits(got, want):
    for k, (a_track, b_track) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(a_track, b_track)):
            assert a.dtype == b.dtype and a.shape == b.shape
            same = a.view(BITS[a.element_size()]) == b.view(BITS[b.element_size()])
            assert bool(same.all()), f"emas[{k}][{i}]: {int((~same).sum())} of {a.numel()} differ"


def separately(emas, src, weights, **stochastic):
    """What K separate lerp_ / lerp_stochastic_ calls give (on copies)."""
    out = clone(emas)
    for k, track in enumerate(out):
        if stochastic:
            fused_ema.lerp_stochastic_(
                track,
                src,
                weights[k],
                seed=stochastic["seeds"][k],
                step=stochastic["step"],
                keys=stochastic["keys"][k],
                offsets=stochastic.get("offsets"),
            )
        else:
            fused_ema.lerp_(track, src, weights[k])
    return out


def track_weights(count, kind, device, offset=0):
    values = [WEIGHTS[(k + offset) % len(WEIGHTS)] for k in range(count)]
    if kind == "float":
        return values, values
    dtype = torch.float32 if kind == "float32" else torch.float64
    tensor = torch.tensor(values, dtype=dtype, device=device)
    return tensor, list(tensor)  # lerp_ takes each as a 0-dim tensor: the same rounding


@pytest.mark.parametrize("tracks", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("kind", ["float", "float32", "float64"])
def test_each_track_equals_its_own_lerp(device, dtype_pair, tracks, kind):
    emas, src = make_tracks([dtype_pair] * tracks, SHAPES, device, seed=tracks)
    weights, per_track = track_weights(tracks, kind, device, offset=tracks)
    want = separately(emas, src, per_track)
    fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


@pytest.mark.parametrize("tracks", range(1, 10))
def test_mixed_lists_and_mixed_tracks(device, tracks):
    """Pairs mixed along the list, and tracks of other EMA dtypes over the same sources."""
    g = torch.Generator().manual_seed(100 + tracks)
    src_dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float32]
    ema_choices = {s: [e for e, t in DTYPE_PAIRS if t == s] for s in src_dtypes}
    shapes = [(37,), (4, 300), (1,), (2050,), (0,)]
    src = [random_tensor(sh, dt, device, g) for sh, dt in zip(shapes, src_dtypes)]
    emas = [
        [
            random_tensor(sh, ema_choices[dt][(k + i) % len(ema_choices[dt])], device, g)
            for i, (sh, dt) in enumerate(zip(shapes, src_dtypes))
        ]
        for k in range(tracks)
    ]
    weights = [WEIGHTS[(k * 5) % len(WEIGHTS)] for k in range(tracks)]
    want = separately(emas, src, weights)
    fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


@pytest.mark.parametrize("pair", SAME_DTYPE_PAIRS, ids=pair_id)
def test_cpu_equals_foreach_lerp(pair):
    emas, src = make_tracks([pair] * 3, SHAPES, "cpu", seed=7)
    weights = [0.3, 0.7, 1e-3]
    want = clone(emas)
    for track, w in zip(want, weights):
        torch._foreach_lerp_(track, src, w)
    fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


@pytest.mark.parametrize("weight", [0.0, -0.0, 0.5, 1.0, 1e-30, 1e-45, -0.25, 1.5])
def test_edge_weights_per_track(device, dtype_pair, weight):
    """One track at the edge weight between ordinary ones; a zero weight leaves its track
    untouched even where src holds inf (lerp_ skips it too)."""
    emas, src = make_tracks([dtype_pair] * 3, SHAPES[:6], device, seed=8)
    src[1][3] = float("inf")
    weights = [0.3, weight, 0.8]
    want = separately(emas, src, weights)
    fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


def test_tensor_weights_on_the_cpu_serve_any_device(device):
    emas, src = make_tracks([(torch.float32, torch.bfloat16)] * 2, SHAPES, device, seed=9)
    weights = torch.tensor([0.1, 0.9])
    want = separately(emas, src, list(weights))
    fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


def test_strided_weights_tensor(device):
    emas, src = make_tracks([(torch.float32, torch.float32)] * 3, SHAPES, device, seed=10)
    weights = torch.tensor([0.1, -1.0, 0.6, -1.0, 0.2], dtype=torch.float64, device=device)[::2]
    want = separately(emas, src, list(weights))
    fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


def views(kind, t):
    """A view of layout `kind` holding t's values, in a larger buffer."""
    if kind == "contiguous":
        return t.clone()
    if kind == "misaligned":
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
    elif kind == "permuted":
        view = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).t()
    else:  # strided: gaps between elements
        view = torch.empty(t.shape[0], 2 * t.shape[1], dtype=t.dtype, device=t.device)[:, ::2]
    view.copy_(t)
    return view


LAYOUTS = ["contiguous", "misaligned", "permuted", "strided"]


@pytest.mark.parametrize("src_layout", LAYOUTS)
def test_views_of_every_layout(device, dtype_pair, src_layout):
    """Each track's EMAs in another layout (so the tracks of one src differ), src in one."""
    g = torch.Generator().manual_seed(11)
    shapes = [(31, 17), (64, 40), (3, 700)]
    src = [views(src_layout, random_tensor(sh, dtype_pair[1], device, g)) for sh in shapes]
    emas = [
        [views(layout, random_tensor(sh, dtype_pair[0], device, g)) for sh in shapes]
        for layout in LAYOUTS
    ]
    weights = [0.2, 0.6, 1e-3, 0.5]
    want = separately(emas, src, weights)
    fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


def test_long_lists_and_large_tensors():
    """3,000 small tensors (prefetched lists, many rows a thread) and tensors that the parallel
    split cuts inside a block."""
    g = torch.Generator().manual_seed(12)
    shapes = [(int(n),) for n in torch.randint(0, 300, (3000,), generator=g)]
    shapes += [(200_003,), (65_537,), (1 << 17,)]
    pair = (torch.float32, torch.bfloat16)
    emas, src = make_tracks([pair] * 4, shapes, "cpu", seed=13)
    weights = [0.1, 0.2, 0.3, 0.4]
    want = separately(emas, src, weights)
    fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


@pytest.fixture(params=fused_ema.build_info()["cpu_isas_available"])
def cpu_isa(request):
    previous = fused_ema.set_cpu_isa(request.param)
    yield request.param
    fused_ema.set_cpu_isa(previous)


@pytest.mark.parametrize("stochastic", [False, True], ids=["lerp", "stochastic"])
def test_every_cpu_isa(cpu_isa, stochastic):
    pairs = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)] * 2
    emas, src = make_tracks(pairs, SHAPES, "cpu", seed=14)
    weights = [0.1, 0.7, 0.3, 1.0]
    if stochastic:
        n = len(src)
        keys = [[k * n + i for i in range(n)] for k in range(4)]
        want = separately(emas, src, weights, seeds=[5] * 4, step=6, keys=keys)
        fused_ema.lerp_many_(emas, src, weights, seed=5, step=6)
    else:
        want = separately(emas, src, weights)
        fused_ema.lerp_many_(emas, src, weights)
    assert_bits(emas, want)


def test_tuples_and_version_counters(device):
    emas, src = make_tracks([(torch.float32, torch.float32)] * 2, SHAPES[:3], device, seed=15)
    versions = [[e._version for e in track] for track in emas]
    want = separately(emas, src, [0.25, 0.5])
    fused_ema.lerp_many_(tuple(tuple(t) for t in emas), tuple(src), (0.25, 0.5))
    assert_bits(emas, want)
    assert [[e._version for e in track] for track in emas] == [
        [v + 1 for v in track] for track in versions
    ]


def test_empty_lists_are_a_no_op():
    fused_ema.lerp_many_([[], []], [], [0.1, 0.2])
    fused_ema.lerp_many_([[]], [], torch.tensor([0.5]))
    fused_ema.lerp_many_([[]], [], [0.5], seed=1, step=1)
    OP.lerp_many_([], [], torch.tensor([0.5]))


# Stochastic rounding.


@pytest.mark.parametrize("tracks", [1, 3, 9])
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_stochastic_tracks_equal_their_own_lerp_stochastic(device, pair, tracks):
    """Per-track seeds, keys and shared shard offsets; float32/float64 EMAs get the plain lerp."""
    emas, src = make_tracks([pair] * tracks, SHAPES, device, seed=20 + tracks)
    n = len(src)
    weights, per_track = track_weights(tracks, "float32", device, offset=2)
    seeds = [2**64 - 1 - k for k in range(tracks)]
    keys = [[(7919 * (k * n + i)) % 2**32 for i in range(n)] for k in range(tracks)]
    offsets = [0, 1, 2, 3, 5, 2**33 + 3, 4097, 0, 6, 2**40]
    step = 2**40 + 3
    want = separately(emas, src, per_track, seeds=seeds, step=step, keys=keys, offsets=offsets)
    fused_ema.lerp_many_(emas, src, weights, seed=seeds, step=step, keys=keys, offsets=offsets)
    assert_bits(emas, want)


@pytest.mark.parametrize("pair", SR_PAIRS, ids=pair_id)
def test_stochastic_defaults_number_every_tensor_of_every_track(device, pair):
    """One seed, default keys k * N + i: track 0 is lerp_stochastic_ with its defaults; a step
    tensor and a weight tensor on the device."""
    emas, src = make_tracks([pair] * 3, SHAPES, device, seed=30)
    n = len(src)
    keys = [[k * n + i for i in range(n)] for k in range(3)]
    want = separately(emas, src, [0.1, 0.5, 0.9], seeds=[11] * 3, step=4, keys=keys)
    first = clone(emas[:1])
    fused_ema.lerp_stochastic_(first[0], src, 0.1, seed=11, step=4)
    assert_bits(first, want[:1])
    weights = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=device)
    step = torch.tensor(4, device=device)
    fused_ema.lerp_many_(emas, src, weights, seed=11, step=step)
    assert_bits(emas, want)


def test_stochastic_views_and_mixed_tracks(device):
    """Non-contiguous 16-bit EMAs are numbered row-major (computed in a stand-in)."""
    g = torch.Generator().manual_seed(31)
    shapes = [(31, 17), (64, 40)]
    src = [random_tensor(sh, torch.float32, device, g) for sh in shapes]
    emas = [
        [views(layout, random_tensor(sh, dtype, device, g)) for sh in shapes]
        for layout, dtype in zip(
            LAYOUTS, [torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
        )
    ]
    keys = [[3 * k + i for i in range(2)] for k in range(4)]
    want = separately(emas, src, [0.2, 0.3, 0.4, 0.5], seeds=[1, 2, 3, 4], step=9, keys=keys)
    fused_ema.lerp_many_(emas, src, [0.2, 0.3, 0.4, 0.5], seed=[1, 2, 3, 4], step=9, keys=keys)
    assert_bits(emas, want)


def test_dtensor_shards():
    """Two tracks of an uneven Shard(0) DTensor on a fake 2-rank group, each rank in turn: the
    shards' stochastic rounding equals the whole tensors' (offsets from the shards' starts)."""
    dist = pytest.importorskip("torch.distributed")
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    emas, src = make_tracks([(torch.bfloat16, torch.float32)] * 2, [(7, 3)], "cpu", seed=32)
    whole = clone(emas)
    fused_ema.lerp_many_(whole, src, [0.1, 0.6], seed=[1, 2], step=2, keys=[[5], [6]])
    pieces = [[], []]
    for rank, rows in enumerate([slice(0, 4), slice(4, 7)]):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,))

            def shard(t, mesh=mesh):
                return tensor_api.DTensor.from_local(
                    t, mesh, [tensor_api.Shard(0)], run_check=False, shape=(7, 3), stride=(3, 1)
                )

            local = [track[0][rows].clone() for track in emas]
            fused_ema.lerp_many_(
                [[shard(t)] for t in local],
                [shard(src[0][rows].clone())],
                [0.1, 0.6],
                seed=[1, 2],
                step=2,
                keys=[[5], [6]],
            )
            plain = [track[0][rows].clone() for track in emas]
            fused_ema.lerp_many_([[shard(t)] for t in plain], [shard(src[0][rows])], [0.1, 0.6])
            for k in range(2):
                pieces[k].append(local[k])
                want = clone([[emas[k][0][rows]]])
                fused_ema.lerp_(want[0], [src[0][rows]], [0.1, 0.6][k])
                assert_bits([[plain[k]]], want)
        finally:
            dist.destroy_process_group()
    assert_bits([[torch.cat(p)] for p in pieces], whole)


# Errors: nothing written, no version counter moved.


def good_tracks(device, tracks=3, count=4, n=257):
    g = torch.Generator().manual_seed(40)
    src = [random_tensor((n,), torch.float32, device, g) for _ in range(count)]
    emas = [[random_tensor((n,), torch.float32, device, g) for _ in range(count)]]
    emas += [[random_tensor((n,), torch.float32, device, g) for _ in range(count)]]
    emas += [[random_tensor((n,), torch.float32, device, g) for _ in range(count)]]
    return emas[:tracks], src


def assert_rejected(call, emas, error, match):
    """call() raises `error` matching `match`, and every EMA tensor keeps its bits and version."""
    tensors = [e for track in emas for e in track if e.device.type != "meta"]
    snapshot = [e.detach().clone() for e in tensors]
    versions = [None if e.is_inference() else e._version for e in tensors]
    with pytest.raises(error, match=match):
        call()
    for e, s in zip(tensors, snapshot):
        assert torch.equal(e, s), "an EMA tensor changed although the call was rejected"
    assert [None if e.is_inference() else e._version for e in tensors] == versions


def raw(emas, src, weights, stochastic=None):
    """The dispatcher entry with the flattened lists."""
    flat = [e for track in emas for e in track]
    if not isinstance(weights, torch.Tensor):
        weights = torch.tensor(weights, dtype=torch.float64)
    if stochastic is None:
        OP.lerp_many_(flat, src, weights)
    else:
        OP.lerp_many_stochastic_(flat, src, weights, *stochastic)


def api(emas, src, weights, stochastic=None):
    if stochastic is None:
        fused_ema.lerp_many_(emas, src, weights)
    else:
        step, seeds, keys, offsets = stochastic
        n = len(src)
        fused_ema.lerp_many_(
            emas,
            src,
            weights,
            seed=seeds,
            step=step,
            keys=[keys[k * n : (k + 1) * n] for k in range(len(emas))],
            offsets=offsets,
        )


@pytest.fixture(params=["api", "raw"])
def entry(request):
    return {"api": api, "raw": raw}[request.param]


def sr_args(emas, src, **change):
    n, k = len(src), len(emas)
    args = {
        "step": torch.tensor(3),
        "seeds": [1] * k,
        "keys": list(range(k * n)),
        "offsets": [0] * n,
    }
    args.update(change)
    return (args["step"], args["seeds"], args["keys"], args["offsets"])


def test_track_of_another_length(device):
    emas, src = good_tracks(device)
    emas[1] = emas[1][:3]
    assert_rejected(
        lambda: fused_ema.lerp_many_(emas, src, [0.1, 0.2, 0.3]),
        emas,
        ValueError,
        r"emas\[1\] has 3 tensors but src has 4",
    )


def test_flat_list_of_another_length_through_the_op(device):
    emas, src = good_tracks(device)
    flat = [e for track in emas for e in track][:-1]
    assert_rejected(
        lambda: OP.lerp_many_(flat, src, torch.tensor([0.1, 0.2, 0.3])),
        emas,
        ValueError,
        r"emas has 11 tensors but 3 weights of 4 src tensors need 12",
    )


@pytest.mark.parametrize(
    "weights, error, match",
    [
        ([0.1, 0.2], ValueError, r"weights has 2 entries but emas has 3 tracks"),
        (torch.tensor([0.1, 0.2]), ValueError, r"weights has 2 elements but emas has 3 tracks"),
        (torch.tensor([[0.1, 0.2, 0.3]]), ValueError, r"1-D tensor of one weight per track"),
        (torch.tensor(0.5), ValueError, r"1-D tensor of one weight per track"),
        (torch.tensor([1, 2, 3]), ValueError, r"float32 or float64, got int64"),
        (torch.tensor([0.1, 0.2, 0.3], dtype=torch.bfloat16), ValueError, r"got bfloat16"),
        ([0.1, float("nan"), 0.3], ValueError, r"weights\[1\] must be finite, got nan"),
        (torch.tensor([0.1, 0.2, float("inf")]), ValueError, r"weights\[2\] must be finite"),
        ([0.1, True, 0.3], TypeError, r"weights\[1\] must be a float, got bool"),
        ([0.1, "0.2", 0.3], TypeError, r"weights\[1\] must be a float, got str"),
        (0.5, TypeError, r"weights must be a list of K floats or a 1-D tensor, got float"),
    ],
)
def test_bad_weights(device, weights, error, match):
    emas, src = good_tracks(device)
    if isinstance(weights, torch.Tensor):
        weights = weights.to(device)
    assert_rejected(lambda: fused_ema.lerp_many_(emas, src, weights), emas, error, match)
    assert_rejected(
        lambda: fused_ema.lerp_many_(emas, src, weights, seed=1, step=1), emas, error, match
    )


@pytest.mark.parametrize(
    "weights, match",
    [
        (torch.tensor([[0.1, 0.2, 0.3]]), r"1-D tensor of one weight per track"),
        (torch.tensor([1, 2, 3]), r"float32 or float64, got int64"),
        (torch.tensor([0.1, float("nan"), 0.3]), r"weights\[1\] must be finite"),
    ],
)
def test_bad_weights_through_the_op(device, weights, match):
    emas, src = good_tracks(device)
    assert_rejected(lambda: raw(emas, src, weights.to(device)), emas, ValueError, match)


def test_weights_requiring_grad(device):
    emas, src = good_tracks(device)
    weights = torch.tensor([0.1, 0.2, 0.3], device=device, requires_grad=True)
    for call in (raw, api):
        assert_rejected(
            lambda call=call: call(emas, src, weights), emas, RuntimeError, "weights requires grad"
        )
    with torch.no_grad():
        fused_ema.lerp_many_(emas, src, weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_weights_for_cpu_emas():
    emas, src = good_tracks("cpu")
    weights = torch.tensor([0.1, 0.2, 0.3], device="cuda")
    assert_rejected(
        lambda: fused_ema.lerp_many_(emas, src, weights), emas, RuntimeError, r"weights is on cuda"
    )


def test_no_track():
    with pytest.raises(ValueError, match="emas holds no track"):
        fused_ema.lerp_many_([], [torch.zeros(3)], [])


@pytest.mark.parametrize(
    "emas, match",
    [
        (torch.zeros(3), r"emas must be a sequence of K tensor lists, got Tensor"),
        ([torch.zeros(3)], r"emas\[0\] must be a sequence of tensors, not a tensor"),
    ],
)
def test_emas_not_lists_of_lists(emas, match):
    with pytest.raises(TypeError, match=match):
        fused_ema.lerp_many_(emas, [torch.zeros(3)], [0.5])


def share_between_tracks(emas, src, device):
    emas[1][2] = emas[0][2]


def overlap_views_in_two_tracks(emas, src, device):
    base = torch.randn(400, device=device)
    emas[0][1], emas[2][3] = base[:257], base[100:357]


def alias_src_to_an_ema_of_its_tensor(emas, src, device):
    src[1] = emas[2][1]


def alias_src_to_another_ema(emas, src, device):
    src[3] = emas[1][0]


def mismatch_shapes(emas, src, device):
    emas[2][1] = torch.randn(16, 16, device=device)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (share_between_tracks, RuntimeError, r"emas\[0\]\[2\] and emas\[1\]\[2\] share memory"),
        (overlap_views_in_two_tracks, RuntimeError, r"emas\[0\]\[1\] and emas\[2\]\[3\] share"),
        (alias_src_to_an_ema_of_its_tensor, RuntimeError, r"src\[1\] aliases emas\[2\]\[1\]"),
        (alias_src_to_another_ema, RuntimeError, r"src\[3\] shares memory with emas\[1\]\[0\]"),
        (mismatch_shapes, ValueError, r"src\[1\] has shape \[257\] but emas\[2\]\[1\] has shape"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_bad_lists(entry, device, change, error, match):
    emas, src = good_tracks(device)
    change(emas, src, device)
    assert_rejected(lambda: entry(emas, src, [0.1, 0.2, 0.3]), emas, error, match)


@pytest.mark.parametrize("ema_dtype", [torch.float16, torch.int32])
def test_unsupported_dtype(entry, device, ema_dtype):
    emas, src = good_tracks(device)
    src[2] = src[2].to(torch.bfloat16)
    emas[0][2] = emas[0][2].to(torch.float32)
    emas[1][2] = emas[1][2].to(ema_dtype)
    emas[2][2] = emas[2][2].to(torch.bfloat16)
    match = (
        r"unsupported dtype pair at emas\[1\]\[2\]: ema float16, src bfloat16"
        if ema_dtype == torch.float16
        else r"emas\[1\]\[2\] has dtype int32"
    )
    assert_rejected(lambda: entry(emas, src, [0.1, 0.2, 0.3]), emas, ValueError, match)


def test_ema_requiring_grad_under_grad_mode(entry, device):
    emas, src = good_tracks(device)
    emas[1][3] = torch.nn.Parameter(emas[1][3])
    assert_rejected(
        lambda: entry(emas, src, [0.1, 0.2, 0.3]),
        emas,
        RuntimeError,
        r"emas\[1\]\[3\] requires grad",
    )
    with torch.no_grad():
        entry(emas, src, [0.1, 0.2, 0.3])


def test_device_mismatch_within_a_pair(entry):
    emas, src = good_tracks("cpu")
    emas[2][0] = torch.randn(257, device="meta")
    assert_rejected(
        lambda: entry(emas, src, [0.1, 0.2, 0.3]),
        emas,
        RuntimeError,
        r"src\[0\] is on cpu but emas\[2\]\[0\] is on meta",
    )


META = "meta tensors hold no data"


def test_meta_tensors(entry):
    emas = [[torch.empty(5, device="meta")], [torch.empty(5, device="meta")]]
    src = [torch.empty(5, device="meta")]
    with pytest.raises(RuntimeError, match=META):
        entry(emas, src, [0.1, 0.2])
    emas, src = good_tracks("cpu")
    weights = torch.tensor([0.1, 0.2, 0.3], device="meta")
    assert_rejected(lambda: entry(emas, src, weights), emas, RuntimeError, META)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"seeds": [1, 2]}, ValueError, r"seed(s)? has 2 entries"),
        ({"keys": [0] * 11}, ValueError, r"keys(\[2\])? has 3 (keys|entries)"),
        ({"offsets": [0, 0, 0]}, ValueError, r"offsets has 3 entries"),
        ({"offsets": [0, -3, 0, 0]}, ValueError, r"offsets\[1\] is -3"),
        ({"step": torch.tensor(1.0)}, ValueError, r"step must be one int64 element"),
        ({"seeds": [1, 2**64, 3]}, ValueError, r"seed must fit in 64 bits"),
    ],
)
def test_bad_rounding_arguments(entry, device, change, error, match):
    emas, src = good_tracks(device)
    if entry is raw and "seeds" in change and max(change["seeds"]) >= 2**63:
        pytest.skip("the op's int[] takes int64s; the API maps 64-bit seeds")
    stochastic = sr_args(emas, src, **change)
    if entry is raw and "keys" in change:
        match = r"keys has 11 entries but emas has 12 tensors"
    assert_rejected(lambda: entry(emas, src, [0.1, 0.2, 0.3], stochastic), emas, error, match)


def test_bad_keys_name_track_and_tensor(device):
    emas, src = good_tracks(device)
    keys = [[0, 1, 2, 3], [4, 5, -1, 7], [8, 9, 10, 11]]
    assert_rejected(
        lambda: fused_ema.lerp_many_(emas, src, [0.1, 0.2, 0.3], seed=1, step=1, keys=keys),
        emas,
        ValueError,
        r"keys\[1\]\[2\] is -1; keys are 32-bit",
    )
    keys[1][2] = 2**32
    assert_rejected(
        lambda: fused_ema.lerp_many_(emas, src, [0.1, 0.2, 0.3], seed=1, step=1, keys=keys),
        emas,
        ValueError,
        r"keys\[1\]\[2\] is 4294967296",
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"step": 1}, TypeError, r"step, keys and offsets go with seed"),
        ({"seed": 1}, TypeError, r"step must be an int"),
        ({"seed": 1.5, "step": 1}, TypeError, r"seed must be an int or K ints"),
        ({"seed": [1, True, 2], "step": 1}, TypeError, r"seed\[1\] must be an int"),
        ({"seed": 1, "step": True}, TypeError, r"step must be an int"),
        ({"seed": 1, "step": 1, "keys": [[0] * 4] * 2}, ValueError, r"keys has 2 lists"),
        ({"seed": 1, "step": 1, "keys": 5}, TypeError, r"keys must be K lists of N ints, got int"),
        ({"seed": 1, "step": 1, "keys": [0, 1, 2]}, TypeError, r"keys\[0\] must be a list of N"),
        (
            {"seed": 1, "step": 1, "keys": [[0] * 4, (1, 2, 3.5, 4), [0] * 4]},
            TypeError,
            r"lerp_many_: keys\[1\]\[2\] must be an int, got float",
        ),
        (
            {"seed": 1, "step": 1, "offsets": (0, 0, 0, 1.5)},
            TypeError,
            r"offsets\[3\] must be an int",
        ),
    ],
)
def test_bad_keyword_arguments(kwargs, error, match):
    emas, src = good_tracks("cpu")
    assert_rejected(
        lambda: fused_ema.lerp_many_(emas, src, [0.1, 0.2, 0.3], **kwargs), emas, error, match
    )


# The dispatcher: opcheck and torch.compile.


def sample_flat(device, pair, tracks=2, seed=50):
    shapes = [(5,), (3, 4), (0,), (2, 3, 65)]
    emas, src = make_tracks([pair] * tracks, shapes, device, seed)
    return [e for track in emas for e in track], src


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_opcheck(device, pair):
    flat, src = sample_flat(device, pair)
    for dtype in (torch.float32, torch.float64):
        weights = torch.tensor([0.3, 0.8], dtype=dtype, device=device)
        torch.library.opcheck(OP.lerp_many_.default, (flat, src, weights))
    step = torch.tensor(5, device=device)
    torch.library.opcheck(
        OP.lerp_many_stochastic_.default,
        (flat, src, torch.tensor([0.3, 0.8]), step, [1, -2], list(range(8)), [0, 3, 0, 7]),
    )


def test_opcheck_non_contiguous(device):
    g = torch.Generator().manual_seed(51)
    flat = [random_tensor((8, 6), torch.float32, device, g).t() for _ in range(2)]
    src = [random_tensor((8, 12), torch.float32, device, g)[:, ::2].t()]
    torch.library.opcheck(OP.lerp_many_.default, (flat, src, torch.tensor([0.6, 0.1])))


@pytest.mark.parametrize("stochastic", [False, True], ids=["lerp", "stochastic"])
@pytest.mark.parametrize("weight_kind", ["float", "tensor"])
def test_compiled_fullgraph_matches_eager(device, weight_kind, stochastic):
    torch._dynamo.reset()
    pair = (torch.bfloat16, torch.float32) if stochastic else (torch.float32, torch.bfloat16)

    def step(emas, src, weights, t):
        if stochastic:
            fused_ema.lerp_many_(emas, src, weights, seed=[3, 4], step=t)
        else:
            fused_ema.lerp_many_(emas, src, weights)
        return [2 * e for track in emas for e in track]  # exact: outputs agree bit for bit

    compiled = torch.compile(step, fullgraph=True)
    emas, src = make_tracks([pair] * 2, [(5,), (3, 4), (0,), (2, 3, 65)], device, seed=52)
    eager = clone(emas)
    for t in range(3):
        values = [0.1 * (t + 1), 0.05]
        weights = values if weight_kind == "float" else torch.tensor(values, device=device)
        got = compiled(emas, src, weights, t)
        want = step(eager, src, weights, t)
        assert_bits([got, [e for tr in emas for e in tr]], [want, [e for tr in eager for e in tr]])


def test_compiled_rejects_bad_input_at_trace_time():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def step(emas, src):
        fused_ema.lerp_many_(emas, src, [0.5, 0.25])

    match = r"src\[0\] has shape \[3\] but emas\[1\]\[0\] has shape \[4\]"
    with pytest.raises(Exception, match=match):
        step([[torch.randn(3)], [torch.randn(4)]], [torch.randn(3)])


def test_fake_tensors_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        emas, src = good_tracks("cpu")
        fused_ema.lerp_many_(emas, src, [0.1, 0.2, 0.3])
        fused_ema.lerp_many_(emas, src, torch.tensor([0.1, 0.2, 0.3]), seed=1, step=2)
