"""The CUDA kernel under both launch layouts: 1,024 tensors a launch in 32 KB of parameters (where
driver and GPU allow) and the 4 KB fallback of 120. Lists across each capacity, multi-chunk and
misaligned tensors, tensor weights and CUDA graphs give the right values, the same under both.
Needs a GPU; the packing itself is checked without one in test_cuda_packing.py."""

import ctypes

import pytest
import torch

import fused_ema
from conftest import DTYPE_PAIRS, assert_lerp_close, pair_id, random_tensor
from testing_ops import cuda_small_params

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not fused_ema.build_info()["cuda_kernel"],
    reason="needs a GPU and the CUDA kernel",
)

COUNTS = [1, 119, 120, 121, 1023, 1024, 1025, 2500]
# Multi-chunk sizes (65,536 elements a block) among the first tensors, small ones after.
SIZES = [3 * 65536 + 11, 65537, 1, 7, 8, 33, 1000, 4097, 17, 2]


@pytest.fixture(params=["large", "small"])
def packing(request):
    previous = cuda_small_params(request.param == "small")
    yield request.param
    cuda_small_params(previous)


def ragged_lists(count, pair, seed=0):
    """`count` pairs of views into two flat buffers, offset so that alignments vary."""
    g = torch.Generator().manual_seed(seed)
    sizes = [SIZES[i] if i < 2 else SIZES[2 + i % (len(SIZES) - 2)] for i in range(count)]
    ema_buf = random_tensor((sum(sizes) + 3 * count,), pair[0], "cuda", g)
    src_buf = random_tensor((sum(sizes) + 3 * count,), pair[1], "cuda", g)
    ema, src, at = [], [], 0
    for i, n in enumerate(sizes):
        ema.append(ema_buf[at + i % 3 : at + i % 3 + n])
        src.append(src_buf[at + (i // 3) % 3 : at + (i // 3) % 3 + n])
        at += n + 3
    return ema, src


def takes_32kb_params():
    """What the kernel decides: a CUDA >= 12.1 build for Volta and newer only, a driver >= 12.1
    and a GPU of compute capability >= 7.0."""
    info = fused_ema.build_info()
    built = tuple(int(p) for p in info["cuda_version_built"].split("."))
    volta_build = min(float(arch) for arch in info["cuda_archs"]) >= 7.0
    driver = ctypes.c_int(0)
    ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(driver))
    gpu = torch.cuda.get_device_capability()[0] >= 7
    return built >= (12, 1) and volta_build and driver.value >= 12010 and gpu


def kernel_launches(fn):
    """Names of the multi_tensor_kernel launches that fn makes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "multi_tensor_kernel" in e.name]


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_lists_across_launch_capacities(packing, pair, count):
    ema, src = ragged_lists(count, pair)
    before = torch.cat([e.clone() for e in ema])
    fused_ema.lerp_(ema, src, 0.3)
    assert_lerp_close(torch.cat(ema), before, torch.cat(src), 0.3)


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_both_layouts_give_identical_bits(pair):
    results = []
    for small in (False, True):
        previous = cuda_small_params(small)
        try:
            ema, src = ragged_lists(1500, pair, seed=3)
            fused_ema.lerp_(ema, src, 0.7)
            results.append(torch.cat(ema).cpu())
        finally:
            cuda_small_params(previous)
    assert torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8))


def test_launch_count_follows_the_layout(packing):
    ema, src = ragged_lists(1025, (torch.float32, torch.float32))
    names = kernel_launches(lambda: fused_ema.lerp_(ema, src, 0.5))
    if not names:
        pytest.skip("the profiler records no CUDA kernels on this machine")
    large = packing == "large" and takes_32kb_params()
    assert len(names) == (2 if large else 9), names
    assert all((", 1024>" if large else ", 120>") in name for name in names), names


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64])
def test_device_weight_and_graph_replay(packing, weight_dtype):
    ema, src = ragged_lists(1100, (torch.float32, torch.bfloat16), seed=5)
    weight = torch.tensor(0.25, dtype=weight_dtype, device="cuda")
    start = torch.cat(ema).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_ema.lerp_(ema, src, weight)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    once = torch.cat(ema).clone()
    assert_lerp_close(once, start, torch.cat(src), 0.25)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_ema.lerp_(ema, src, weight)
    weight.fill_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert_lerp_close(torch.cat(ema), once, torch.cat(src), 0.5)
