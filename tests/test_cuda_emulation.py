"""The CUDA kernels' device code run on the CPU, bit for bit against the CPU kernel.

tests/cuda/emulation.cpp compiles csrc/cuda's kernels with the host compiler (the device code is
host+device: no second copy) and runs every thread of every block of each launch that the real
packing makes, for the 4 KB and the 32 KB layouts, over real tensor memory. Every dtype pair,
views misaligned every way, sizes around pack and chunk edges, empty tensors, lists needing many
launches, weights on both sides of 0.5 and as device-side tensors, stochastic rounding (keys from
names and indices, shard offsets) and the schedule kernel. Each EMA view sits inside a larger
buffer: writes outside it, a missed element or one updated twice (lerp twice != lerp once) all
show up as differing bits."""

import hashlib
import itertools
import math
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

import fused_ema
from conftest import DTYPE_PAIRS, pair_id, random_tensor
from fused_ema._update.plan import stream_key

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 65536  # kChunkElems: elements per block
LAYOUTS = {"4KB": False, "32KB": True}
SR_PAIRS = [p for p in DTYPE_PAIRS if p[0] in (torch.bfloat16, torch.float16)]
BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
GUARD = 8  # elements of buffer between views


def cuda_include_dir():
    """Where cuda_runtime.h and cuda_bf16.h are: CUDA_HOME, CUDA_PATH, nvcc's toolkit or
    /usr/local/cuda."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc := shutil.which("nvcc"):
        roots.append(str(Path(nvcc).resolve().parents[1]))
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        include = Path(root) / "include"
        if (include / "cuda_runtime.h").exists() and (include / "cuda_bf16.h").exists():
            return include
    return None


@pytest.fixture(scope="session")
def emu():
    """torch.ops.fused_ema_emulation, built once (then cached in torch's extensions dir; ninja
    rebuilds it when a header changes)."""
    include = cuda_include_dir()
    if include is None:
        pytest.skip("no CUDA headers (cuda_runtime.h, cuda_bf16.h): set CUDA_HOME")
    from torch.utils.cpp_extension import load

    tag = hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]  # one build per checkout
    load(
        name=f"fused_ema_emulation_{tag}",
        sources=[str(ROOT / "tests" / "cuda" / "emulation.cpp")],
        extra_include_paths=[str(ROOT / "csrc"), str(ROOT / "tests" / "cuda"), str(include)],
        extra_cflags=["-O2", "-fno-strict-aliasing", "-Wno-unknown-pragmas"],
        is_python_module=False,
    )
    return torch.ops.fused_ema_emulation


@pytest.fixture(scope="session")
def capacities(emu):
    small, large, sr_small, sr_large = emu.capacities()[:4]
    return {
        (False, False): small,
        (False, True): large,
        (True, False): sr_small,
        (True, True): sr_large,
    }


def pack_of(pair):
    """Elements per 16-byte access of the narrower side (LerpOp::kPack)."""
    return 16 // (min(torch.finfo(pair[0]).bits, torch.finfo(pair[1]).bits) // 8)


class Lists:
    """EMA and source views of (numel, ema offset, src offset) elements, each view starting that
    many elements after a 16-byte boundary of one buffer of fresh random data per side, with gaps
    between views; the EMA buffer can be copied so two kernels start from equal bits."""

    def __init__(self, pair, layout, seed):
        g = torch.Generator().manual_seed(seed)
        self.layout = layout
        self.ema_starts, ema_len = self._starts(1)
        src_starts, src_len = self._starts(2)
        self.ema_buf = random_tensor((ema_len,), pair[0], "cpu", g)
        src_buf = random_tensor((src_len,), pair[1], "cpu", g)
        self.src = [src_buf[a : a + n] for a, (n, _, _) in zip(src_starts, layout)]

    def _starts(self, side):
        starts, end = [], 0
        for item in self.layout:
            start = -(-(end + GUARD) // 16) * 16 + item[side]
            starts.append(start)
            end = start + item[0]
        return starts, end + GUARD

    def copy(self):
        buf = self.ema_buf.clone()
        return buf, [buf[a : a + n] for a, (n, _, _) in zip(self.ema_starts, self.layout)]


def assert_same_bits(got, want):
    same = got.view(BITS[got.element_size()]) == want.view(BITS[want.element_size()])
    assert bool(same.all()), f"{int((~same).sum())} of {got.numel()} elements differ"


def edge_layout(pack, big_sizes=True):
    """Sizes around the pack edges for every pair of misalignments (ema, src offsets in 0..pack-1)
    and empty tensors; then sizes around the chunk edges for a few of those pairs."""
    small = sorted({0, 1, pack - 1, pack, pack + 1, 2 * pack + 1, 511, 1000} - {0}) + [0]
    layout = [(n, e, s) for e, s in itertools.product(range(pack), repeat=2) for n in small]
    if big_sizes:
        big = [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + pack + 1, 3 * CHUNK - 1]
        offsets = [(0, 0), (1, 1), (1, 0), (pack - 1, 0), (0, pack - 1)]
        layout += [(n, e, s) for n in big for e, s in offsets]
    return layout


def expected_counts(pair, ema, src, capacity, tracks=()):
    """Launches and blocks multi_tensor_apply's packing makes (no launch near INT32_MAX blocks).
    `tracks`: lerp_many_'s other tracks' EMA lists, which must share the head's alignment."""
    pack = pack_of(pair)
    blocks = 0
    tensors = 0
    for i, (e, s) in enumerate(zip(ema, src)):
        n = e.numel()
        if n == 0:
            continue
        tensors += 1
        head = next(
            (
                min(k, n)
                for k in range(pack)
                if all((t.data_ptr() + k * t.element_size()) % 16 == 0 for t in [e, s])
            ),
            -1,
        )
        if any(t[i].data_ptr() % 16 != e.data_ptr() % 16 for t in tracks):
            head = -1
        if head < 0:
            blocks += -(-n // CHUNK)
        else:
            blocks += max(1, -(-((n - head) // pack) // (CHUNK // pack)))
    return [-(-tensors // capacity), blocks]


def run_lerp(emu, lists, weight, large, weight_tensor=None):
    """(emulated buffers, launch counts), (CPU kernel buffers)."""
    emu_buf, emu_views = lists.copy()
    counts = emu.lerp_(emu_views, lists.src, float(weight), weight_tensor, large)
    cpu_buf, cpu_views = lists.copy()
    fused_ema.lerp_(cpu_views, lists.src, weight if weight_tensor is None else weight_tensor)
    return emu_buf, counts, cpu_buf


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_lerp_matches_the_cpu_kernel(emu, capacities, pair, layout):
    lists = Lists(pair, edge_layout(pack_of(pair)), seed=1)
    large = LAYOUTS[layout]
    for weight in (0.3, 0.7):
        emu_buf, counts, cpu_buf = run_lerp(emu, lists, weight, large)
        assert_same_bits(emu_buf, cpu_buf)
    _, views = lists.copy()
    assert counts == expected_counts(pair, views, lists.src, capacities[False, large])


@pytest.mark.parametrize("weight", [0.0, 1e-4, 0.25, 0.49999997, 0.5, 0.7, 1.0, -0.25, 1.5])
def test_weights_on_both_sides_of_one_half(emu, weight):
    """PyTorch's formula switches base at |w| = 0.5; weight 0 is skipped without a write, 1
    copies the source."""
    for i, pair in enumerate(DTYPE_PAIRS):
        lists = Lists(pair, edge_layout(pack_of(pair), big_sizes=False)[::7], seed=10 + i)
        emu_buf, _, cpu_buf = run_lerp(emu, lists, weight, large=i % 2 == 1)
        assert_same_bits(emu_buf, cpu_buf)
        if weight == 0.0:
            assert_same_bits(emu_buf, lists.ema_buf)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64], ids=str)
def test_weight_read_through_a_device_pointer(emu, weight_dtype, layout):
    """A 0-dim weight tensor reaches the kernel as TrackWeights' pointer (0.1 differs in float32
    and float64: a float64 EMA shows which one was read)."""
    for i, pair in enumerate(DTYPE_PAIRS):
        lists = Lists(pair, edge_layout(pack_of(pair), big_sizes=False)[::5], seed=20 + i)
        for value in (0.1, 0.7, 0.0):
            weight = torch.tensor(value, dtype=weight_dtype)
            emu_buf, _, cpu_buf = run_lerp(emu, lists, 0.9, LAYOUTS[layout], weight)
            assert_same_bits(emu_buf, cpu_buf)


def small_list(count, seed):
    """`count` sizes from 0 to 40 (about one in ten empty), misaligned by 0 to 7 elements."""
    rng = random.Random(seed)
    return [
        (rng.choice([0] + list(range(1, 41)) * 4), rng.randrange(8), rng.randrange(8))
        for _ in range(count)
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["lerp", "stochastic"])
def test_lists_that_need_many_launches(emu, capacities, stochastic, layout):
    large = LAYOUTS[layout]
    capacity = capacities[stochastic, large]
    pair = (torch.bfloat16, torch.float32) if stochastic else (torch.float32, torch.bfloat16)
    lists = Lists(pair, small_list(2 * capacity + capacity // 2, seed=3), seed=3)
    nonempty = sum(n > 0 for n, _, _ in lists.layout)
    assert nonempty > 2 * capacity
    emu_buf, emu_views = lists.copy()
    cpu_buf, cpu_views = lists.copy()
    if stochastic:
        keys = list(range(len(emu_views)))
        offsets = [0] * len(emu_views)
        counts = emu.lerp_stochastic_(
            emu_views, lists.src, 0.3, None, 7, 11, None, keys, offsets, large
        )
        fused_ema.lerp_stochastic_(cpu_views, lists.src, 0.3, seed=7, step=11)
    else:
        counts = emu.lerp_(emu_views, lists.src, 0.3, None, large)
        fused_ema.lerp_(cpu_views, lists.src, 0.3)
    assert_same_bits(emu_buf, cpu_buf)
    assert counts == [math.ceil(nonempty / capacity), nonempty]  # one block per small tensor


def as_int64(value):
    """A 64-bit value as the int64 with the same bits (how ops.py passes a seed)."""
    return value - 2**64 if value >= 2**63 else value


def run_stochastic(emu, lists, weight, seed, step, keys, offsets, large, weight_tensor=None):
    emu_buf, emu_views = lists.copy()
    step_tensor = step if isinstance(step, torch.Tensor) else None
    emu.lerp_stochastic_(
        emu_views,
        lists.src,
        float(weight),
        weight_tensor,
        as_int64(seed),
        0 if step_tensor is not None else step,
        step_tensor,
        keys,
        offsets,
        large,
    )
    cpu_buf, cpu_views = lists.copy()
    fused_ema.lerp_stochastic_(
        cpu_views,
        lists.src,
        weight if weight_tensor is None else weight_tensor,
        seed=seed,
        step=step,
        keys=keys,
        offsets=offsets,
    )
    return emu_buf, cpu_buf


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_stochastic_rounding_matches_the_cpu_kernel(emu, pair, layout):
    """Keys from ModelEma's names (stream_key) and offsets of shards, some odd (a pack then
    starts inside an element pair); float32/float64 EMAs get the plain lerp."""
    lists = Lists(pair, edge_layout(pack_of(pair)), seed=4)
    count = len(lists.src)
    keys = [stream_key(f"blocks.{i}.weight") for i in range(count)]
    shard_starts = [0, 1, 2, 3, 5, 4097, 2**33 + 3, 2**40]
    offsets = [shard_starts[i % len(shard_starts)] for i in range(count)]
    for weight, seed, step in ((0.3, 2**64 - 5, 2**40 + 3), (0.7, 0, 1)):
        emu_buf, cpu_buf = run_stochastic(
            emu, lists, weight, seed, step, keys, offsets, LAYOUTS[layout]
        )
        assert_same_bits(emu_buf, cpu_buf)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", SR_PAIRS, ids=pair_id)
def test_stochastic_step_and_weight_read_through_device_pointers(emu, pair, layout):
    """The default keys (list indices), a 0-dim int64 step and a 0-dim weight tensor."""
    lists = Lists(pair, edge_layout(pack_of(pair), big_sizes=False)[::3], seed=5)
    count = len(lists.src)
    keys, offsets = list(range(count)), [0] * count
    for weight_dtype, step in ((torch.float32, 3), (torch.float64, 2**35 + 1)):
        weight = torch.tensor(0.1, dtype=weight_dtype)
        step_tensor = torch.tensor(step, dtype=torch.int64)
        emu_buf, cpu_buf = run_stochastic(
            emu, lists, 0.9, 99, step_tensor, keys, offsets, LAYOUTS[layout], weight
        )
        assert_same_bits(emu_buf, cpu_buf)


@pytest.mark.parametrize("pair", SR_PAIRS, ids=pair_id)
def test_stochastic_shards_at_any_offset_match_the_whole_tensor(emu, pair):
    """A tensor cut into shards at odd element counts, each emulated with its first element's
    index as offset, equals the CPU kernel's update of the whole tensor. The tensor starts 2
    elements past a 16-byte boundary, so packs start inside element pairs."""
    n = 2 * CHUNK + 77
    lists = Lists(pair, [(n, 2, 2)], seed=6)
    key = stream_key("head.weight")
    whole_buf, whole = lists.copy()
    fused_ema.lerp_stochastic_(whole, lists.src, 0.3, seed=5, step=9, keys=[key])
    cuts = [0, 1, 6, 4099, CHUNK + 2, CHUNK + 3, 2 * CHUNK + 1, n]
    buf, views = lists.copy()
    shards = [views[0][a:b] for a, b in zip(cuts, cuts[1:])]
    src = [lists.src[0][a:b] for a, b in zip(cuts, cuts[1:])]
    emu.lerp_stochastic_(shards, src, 0.3, None, 5, 9, None, [key] * len(shards), cuts[:-1], True)
    assert_same_bits(buf, whole_buf)


NONE, POWER, DIFFUSERS, TORCH_EMA = 0, 1, 2, 3  # warmup kinds (schedule_formula.h)


def schedule_configs():
    rng = random.Random(8)
    configs = []
    for kind, every, plain, after in itertools.product(
        (NONE, POWER, DIFFUSERS, TORCH_EMA), (1, 3), (0, 1), (0, 5)
    ):
        decay = rng.choice([0.0, 0.5, 0.999, 0.9999, 1.0])
        min_decay = rng.uniform(0.0, decay)
        configs.append(
            [
                decay,
                min_decay,
                rng.uniform(0.5, 5.0),
                rng.uniform(0.1, 1.0),
                after,
                every,
                kind,
                plain,
                0.0,
                0.0,
                0.0,
                0.0,
            ]
        )
    for kind, every, after in itertools.product((5, 6, 7), (1, 3), (0, 5)):
        configs.append(
            [1.0, rng.choice([0.0, 0.1]), 0.0, 1.0, after, every, kind, 0.0]
            + [rng.choice([10.0, 0.0]), rng.uniform(0.5, 2.0), rng.uniform(0, 1), 8.0]
        )
    return configs


STEPS = [-(2**63), -1, 0, 1, 2, 3, 4, 5, 6, 7, 10, 57, 1000, 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1]


def test_schedule_kernel_body_matches_the_cpu_op(emu):
    """ema_schedule_kernel's body against the CPU op, advancing or not, across configs and steps
    (the largest step wraps when advanced)."""
    cpu_op = torch.ops.fused_ema.ema_schedule_
    for config, step, advance in itertools.product(schedule_configs(), STEPS, (False, True)):
        config = torch.tensor(config, dtype=torch.float64)
        states = []
        for op in (emu.schedule_, cpu_op):
            step_t = torch.tensor(step, dtype=torch.int64)
            out = torch.full((2,), -1.0, dtype=torch.float64)
            op(step_t, out, config, advance)
            states.append((int(step_t), out.view(torch.int64).tolist()))
        assert states[0] == states[1], (config.tolist(), step, advance, states)


def test_schedule_kernel_body_writes_weight_0_for_a_bad_config(emu):
    """The device cannot raise: a config the CPU op refuses gives weight 0 and decay NaN."""
    config = torch.tensor([1.5, 0.0, 1.0, 1.0, 0, 1, NONE, 0, 0, 0, 0, 0], dtype=torch.float64)
    with pytest.raises(ValueError, match="decay"):
        torch.ops.fused_ema.ema_schedule_(
            torch.tensor(3), torch.zeros(2, dtype=torch.float64), config, True
        )
    step = torch.tensor(3)
    out = torch.ones(2, dtype=torch.float64)
    emu.schedule_(step, out, config, True)
    assert int(step) == 4 and out[0] == 0.0 and math.isnan(out[1])


# lerp_many_: the tracks' EMAs lie in buffers of their own (views at the same sizes, misaligned
# alike or each its own way) over one source list; every track must come out bit for bit as the
# CPU kernel's lerp_ of that track alone.


@pytest.fixture(scope="session")
def many_capacities(emu):
    small, large, sr_small, sr_large, tracks = emu.capacities()[4:]
    return {
        (False, False): small,
        (False, True): large,
        (True, False): sr_small,
        (True, True): sr_large,
        "tracks": tracks,
    }


class Tracks:
    """K tracks over one source list: track k's EMAs are views of Lists(pairs[k], its layout),
    its layout that of the sources with the EMA offsets moved by `shift * k` elements (mod the
    pack: shift 0 keeps every track aligned alike, 1 gives each its own alignment)."""

    def __init__(self, pairs, layout, seed, shift=0):
        pack = pack_of(pairs[0])
        self.tracks = [
            Lists(pair, [(n, (e + shift * k) % pack, s) for n, e, s in layout], seed + k)
            for k, pair in enumerate(pairs)
        ]
        self.src = self.tracks[0].src

    def copy(self):
        """Fresh copies of every track's buffer, and their views."""
        copies = [t.copy() for t in self.tracks]
        return [buf for buf, _ in copies], [views for _, views in copies]


def run_many(emu, tracks, weights, large, weight_tensor=None, stochastic=None):
    """(emulated buffers, launch counts), (buffers of K CPU lerp_ / lerp_stochastic_ calls)."""
    emu_bufs, emu_views = tracks.copy()
    flat = [v for views in emu_views for v in views]
    if stochastic is None:
        counts = emu.lerp_many_(flat, tracks.src, weights, weight_tensor, large)
    else:
        seeds, step, keys, offsets = stochastic
        step_tensor = step if isinstance(step, torch.Tensor) else None
        counts = emu.lerp_many_stochastic_(
            flat,
            tracks.src,
            weights,
            weight_tensor,
            [as_int64(s) for s in seeds],
            0 if step_tensor is not None else step,
            step_tensor,
            [key for row in keys for key in row],
            offsets,
            large,
        )
    cpu_bufs, cpu_views = tracks.copy()
    for k, views in enumerate(cpu_views):
        weight = weights[k] if weight_tensor is None else weight_tensor[k]
        if stochastic is None:
            fused_ema.lerp_(views, tracks.src, weight)
        else:
            fused_ema.lerp_stochastic_(
                views, tracks.src, weight, seed=seeds[k], step=step, keys=keys[k], offsets=offsets
            )
    return emu_bufs, counts, cpu_bufs


def assert_tracks_same_bits(got, want):
    for k, (a, b) in enumerate(zip(got, want)):
        same = a.view(BITS[a.element_size()]) == b.view(BITS[b.element_size()])
        assert bool(same.all()), f"track {k}: {int((~same).sum())} of {a.numel()} elements differ"


MANY_WEIGHTS = [0.3, 0.7, 1e-3, 0.5, 1.0, 0.25, 0.9999, 0.49999997, 1e-4, 0.6]


@pytest.mark.parametrize("tracks", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_lerp_many_matches_lerp_per_track(emu, capacities, many_capacities, pair, layout, tracks):
    """Every track aligned alike (the packed body); sizes around pack edges, and chunk edges for
    K = 1 and 3; K = 9 takes a second round of launches for the ninth track. K = 1 takes lerp_'s
    launches, as the runner does."""
    big = tracks in (1, 3)
    lists = Tracks([pair] * tracks, edge_layout(pack_of(pair), big_sizes=big), seed=60 + tracks)
    weights = MANY_WEIGHTS[:tracks]
    emu_bufs, counts, cpu_bufs = run_many(emu, lists, weights, LAYOUTS[layout])
    assert_tracks_same_bits(emu_bufs, cpu_bufs)
    _, views = lists.tracks[0].copy()
    capacity = (capacities if tracks == 1 else many_capacities)[False, LAYOUTS[layout]]
    rounds = -(-tracks // many_capacities["tracks"])
    launches, blocks = expected_counts(pair, views, lists.src, capacity)
    assert counts == [rounds * launches, rounds * blocks]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_lerp_many_tracks_misaligned_each_their_own_way(emu, many_capacities, pair, layout):
    """A tensor whose tracks' EMAs differ in alignment takes the element-wise path."""
    lists = Tracks([pair] * 3, edge_layout(pack_of(pair)), seed=70, shift=1)
    emu_bufs, counts, cpu_bufs = run_many(emu, lists, [0.3, 0.7, 0.1], LAYOUTS[layout])
    assert_tracks_same_bits(emu_bufs, cpu_bufs)
    views = [track.copy()[1] for track in lists.tracks]
    capacity = many_capacities[False, LAYOUTS[layout]]
    assert counts == expected_counts(pair, views[0], lists.src, capacity, views[1:])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64], ids=str)
def test_lerp_many_weights_read_through_a_device_pointer(emu, weight_dtype, layout):
    """A 1-D weights tensor (strided, zeros among its values: such tracks skip every write)."""
    for i, pair in enumerate(DTYPE_PAIRS):
        layout_ = edge_layout(pack_of(pair), big_sizes=False)[::5]
        lists = Tracks([pair] * 9, layout_, seed=80 + i, shift=i % 2)
        values = [0.1, 0.0, 0.7, 0.5, 1e-3, 0.0, 0.9, 0.3, 0.6]
        weights = torch.tensor([v for v in values for _ in range(2)], dtype=weight_dtype)[::2]
        emu_bufs, _, cpu_bufs = run_many(emu, lists, [], LAYOUTS[layout], weights)
        assert_tracks_same_bits(emu_bufs, cpu_bufs)


def test_lerp_many_host_zero_weights_and_mixed_tracks(emu):
    """Tracks of other EMA dtypes over one source (a launch per dtype pair and round) and host
    weights of 0 (those tracks are left out of the launches)."""
    ema_dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    pairs = [(e, torch.float32) for e in ema_dtypes] * 2
    for large in (False, True):
        lists = Tracks(pairs, edge_layout(8, big_sizes=False), seed=90)
        weights = [0.3, 0.0, 0.7, 0.2, 0.9, 0.0, 0.4, 0.6, 1.0, 0.1]
        emu_bufs, _, cpu_bufs = run_many(emu, lists, weights, large)
        assert_tracks_same_bits(emu_bufs, cpu_bufs)
        assert_same_bits(emu_bufs[1], lists.tracks[1].ema_buf)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["lerp", "stochastic"])
def test_lerp_many_lists_that_need_many_launches(emu, many_capacities, stochastic, layout):
    large = LAYOUTS[layout]
    capacity = many_capacities[stochastic, large]
    pair = (torch.bfloat16, torch.float32) if stochastic else (torch.float32, torch.bfloat16)
    lists = Tracks([pair] * 3, small_list(2 * capacity + capacity // 2, seed=9), seed=9)
    count = len(lists.src)
    nonempty = sum(n > 0 for n, _, _ in lists.tracks[0].layout)
    assert nonempty > 2 * capacity
    sr = None
    if stochastic:
        sr = ([5, 6, 7], 11, [[k * count + i for i in range(count)] for k in range(3)], [0] * count)
    emu_bufs, counts, cpu_bufs = run_many(emu, lists, [0.3, 0.2, 0.1], large, stochastic=sr)
    assert_tracks_same_bits(emu_bufs, cpu_bufs)
    assert counts == [math.ceil(nonempty / capacity), nonempty]


@pytest.mark.parametrize("tracks", [1, 3, 9])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_lerp_many_stochastic_matches_lerp_stochastic_per_track(emu, pair, layout, tracks):
    """Seeds per track, keys from names per track and tensor, shard offsets (some not a multiple
    of 4); float32/float64 EMAs get the plain lerp."""
    lists = Tracks([pair] * tracks, edge_layout(pack_of(pair), big_sizes=tracks == 3), seed=100)
    count = len(lists.src)
    keys = [
        [stream_key(f"track{k}.blocks.{i}.weight") for i in range(count)] for k in range(tracks)
    ]
    shard_starts = [0, 1, 2, 3, 5, 4097, 2**33 + 3, 2**40]
    offsets = [shard_starts[i % len(shard_starts)] for i in range(count)]
    seeds = [2**64 - 5 - k for k in range(tracks)]
    sr = (seeds, 2**40 + 3, keys, offsets)
    emu_bufs, _, cpu_bufs = run_many(
        emu, lists, MANY_WEIGHTS[:tracks], LAYOUTS[layout], stochastic=sr
    )
    assert_tracks_same_bits(emu_bufs, cpu_bufs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", SR_PAIRS, ids=pair_id)
def test_lerp_many_stochastic_step_and_weights_through_device_pointers(emu, pair, layout):
    lists = Tracks([pair] * 9, edge_layout(pack_of(pair), big_sizes=False)[::3], seed=110, shift=1)
    count = len(lists.src)
    keys = [[k * count + i for i in range(count)] for k in range(9)]
    weights = torch.tensor([0.1, 0.0, 0.3, 0.9, 0.5, 0.2, 1e-3, 0.7, 0.4], dtype=torch.float32)
    step = torch.tensor(2**35 + 1, dtype=torch.int64)
    sr = (list(range(1, 10)), step, keys, [0] * count)
    emu_bufs, _, cpu_bufs = run_many(emu, lists, [], LAYOUTS[layout], weights, stochastic=sr)
    assert_tracks_same_bits(emu_bufs, cpu_bufs)


# bema_: ema, theta0 and out lie in buffers of their own (views at the same sizes, misaligned alike
# or each its own way) over one source list; all three must come out bit for bit as the CPU
# kernel's bema_ leaves them, guard elements between the views included.


@pytest.fixture(scope="session")
def bema_capacities(emu):
    small, large = emu.bema_capacities()
    return {False: small, True: large}


class BemaLists:
    """ema, theta0, out: views of Lists(pair, its layout) each, the EMA offsets of list k moved
    by shifts[k] elements (mod the pack), over list 0's sources."""

    def __init__(self, pair, layout, seed, shifts=(0, 0, 0)):
        pack = pack_of(pair)
        self.lists = [
            Lists(pair, [(n, (e + shift) % pack, s) for n, e, s in layout], seed + k)
            for k, shift in enumerate(shifts)
        ]
        self.src = self.lists[0].src

    def copy(self):
        copies = [lists.copy() for lists in self.lists]
        return [buf for buf, _ in copies], [views for _, views in copies]


def run_bema(emu, lists, weights, large, weight_tensor=None):
    """(emulated buffers, launch counts), (buffers of the CPU kernel's bema_)."""
    emu_bufs, emu_views = lists.copy()
    host = [] if weight_tensor is not None else [float(w) for w in weights]
    counts = emu.bema_(*emu_views, lists.src, host, weight_tensor, large)
    cpu_bufs, cpu_views = lists.copy()
    fused_ema.bema_(*cpu_views, lists.src, weights if weight_tensor is None else weight_tensor)
    return emu_bufs, counts, cpu_bufs


BEMA_WEIGHTS = [
    (0.9, 0.3, 2.5),
    (0.0, 1.0, 0.6),
    (1.0, 1.0, 0.0),
    (0.3, 0.0, 0.0),
    (0.0, 0.6, 0.0),
    (0.0, 0.0, 1.5),
    (0.999, 0.7, -0.5),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_bema_matches_the_cpu_kernel(emu, bema_capacities, pair, layout):
    """Every list aligned alike (the packed body); sizes around pack and chunk edges for one set
    of weights, around pack edges for every zero/nonzero combination."""
    large = LAYOUTS[layout]
    lists = BemaLists(pair, edge_layout(pack_of(pair)), seed=120)
    emu_bufs, counts, cpu_bufs = run_bema(emu, lists, BEMA_WEIGHTS[0], large)
    assert_tracks_same_bits(emu_bufs, cpu_bufs)
    _, views = lists.lists[0].copy()
    assert counts == expected_counts(pair, views, lists.src, bema_capacities[large])
    small = BemaLists(pair, edge_layout(pack_of(pair), big_sizes=False), seed=121)
    for weights in BEMA_WEIGHTS[1:]:
        emu_bufs, _, cpu_bufs = run_bema(emu, small, weights, large)
        assert_tracks_same_bits(emu_bufs, cpu_bufs)
        for k, w in enumerate(weights):
            if w == 0.0:  # a weight of 0 leaves its list as it was
                assert_same_bits(emu_bufs[k], small.lists[k].ema_buf)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_bema_lists_misaligned_each_their_own_way(emu, bema_capacities, pair, layout):
    """A tensor whose theta0 or out differs in alignment from its EMA takes the element-wise
    path; with only theta0 to update, theta0 takes the EMA's place (no EMA read) and its own
    alignment decides."""
    for shifts in ((0, 1, 0), (0, 0, 1), (1, 2, 3)):
        lists = BemaLists(pair, edge_layout(pack_of(pair), big_sizes=False), 130, shifts)
        emu_bufs, counts, cpu_bufs = run_bema(emu, lists, (0.9, 0.3, 2.5), LAYOUTS[layout])
        assert_tracks_same_bits(emu_bufs, cpu_bufs)
        views = [lst.copy()[1] for lst in lists.lists]
        capacity = bema_capacities[LAYOUTS[layout]]
        assert counts == expected_counts(pair, views[0], lists.src, capacity, views[1:])
        emu_bufs, counts, cpu_bufs = run_bema(emu, lists, (0.0, 0.6, 0.0), LAYOUTS[layout])
        assert_tracks_same_bits(emu_bufs, cpu_bufs)
        assert counts == expected_counts(pair, views[1], lists.src, capacity)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64], ids=str)
def test_bema_weights_read_through_a_device_pointer(emu, weight_dtype, layout):
    """A strided 1-D weights tensor (0.1 differs in float32 and float64: a float64 EMA shows
    which was read); zeros among its values skip their writes in the kernel."""
    for i, pair in enumerate(DTYPE_PAIRS):
        lists = BemaLists(
            pair, edge_layout(pack_of(pair), big_sizes=False)[::3], 140 + i, (0, i % 2, 0)
        )
        for values in (
            (0.1, 0.7, 1.1),
            (0.0, 1.0, 0.1),
            (0.1, 0.0, 0.0),
            (0.0, 0.4, 0.0),
            (0, 0, 0),
        ):
            weights = torch.tensor([v for v in values for _ in range(2)], dtype=weight_dtype)[::2]
            emu_bufs, _, cpu_bufs = run_bema(emu, lists, values, LAYOUTS[layout], weights)
            assert_tracks_same_bits(emu_bufs, cpu_bufs)
            for k, w in enumerate(values):
                if w == 0.0:
                    assert_same_bits(emu_bufs[k], lists.lists[k].ema_buf)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bema_lists_that_need_many_launches(emu, bema_capacities, layout):
    large = LAYOUTS[layout]
    capacity = bema_capacities[large]
    pair = (torch.float32, torch.bfloat16)
    lists = BemaLists(pair, small_list(2 * capacity + capacity // 2, seed=9), seed=150)
    nonempty = sum(n > 0 for n, _, _ in lists.lists[0].layout)
    assert nonempty > 2 * capacity
    emu_bufs, counts, cpu_bufs = run_bema(emu, lists, (0.9, 0.2, 1.5), large)
    assert_tracks_same_bits(emu_bufs, cpu_bufs)
    assert counts == [math.ceil(nonempty / capacity), nonempty]
