"""The op is a real dispatcher citizen: torch.library.opcheck passes on both overloads, and a
torch.compile(fullgraph=True) function that calls it runs with no graph break and matches eager."""

import pytest
import torch

import fused_ema
from conftest import DTYPE_PAIRS, pair_id, random_tensor


def sample_lists(device, pair, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5,), (3, 4), (0,), (2, 3, 65)]
    ema = [random_tensor(sh, pair[0], device, g) for sh in shapes]
    src = [random_tensor(sh, pair[1], device, g) for sh in shapes]
    return ema, src


@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=pair_id)
def test_opcheck_float_weight(device, pair):
    ema, src = sample_lists(device, pair, 0)
    torch.library.opcheck(torch.ops.fused_ema.lerp_.default, (ema, src, 0.3))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64])
def test_opcheck_tensor_weight(device, weight_dtype):
    ema, src = sample_lists(device, (torch.float32, torch.bfloat16), 1)
    weight = torch.tensor(0.25, dtype=weight_dtype, device=device)
    torch.library.opcheck(torch.ops.fused_ema.lerp_.Tensor, (ema, src, weight))


def test_opcheck_non_contiguous(device):
    g = torch.Generator().manual_seed(2)
    ema = [random_tensor((8, 6), torch.float32, device, g).t()]
    src = [random_tensor((8, 12), torch.float32, device, g)[:, ::2].t()]
    torch.library.opcheck(torch.ops.fused_ema.lerp_.default, (ema, src, 0.6))


@pytest.mark.parametrize("weight_kind", ["float", "tensor"])
def test_compiled_fullgraph_matches_eager(device, weight_kind):
    torch._dynamo.reset()

    def step(ema, src, weight):
        fused_ema.lerp_(ema, src, weight)
        return [2 * e for e in ema]  # exact, so compiled and eager outputs agree bit for bit

    compiled = torch.compile(step, fullgraph=True)
    ema, src = sample_lists(device, (torch.float32, torch.bfloat16), 3)
    eager_ema = [e.clone() for e in ema]
    for k in range(3):
        w = 0.1 * (k + 1)
        weight = w if weight_kind == "float" else torch.tensor(w, device=device)
        got = compiled(ema, src, weight)
        expected = step(eager_ema, src, weight)
        for a, b in zip(got + ema, expected + eager_ema):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_rejects_bad_input_at_trace_time():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def step(ema, src):
        fused_ema.lerp_(ema, src, 0.5)

    with pytest.raises(Exception, match=r"src\[0\] has shape \[3\] but ema\[0\] has shape \[4\]"):
        step([torch.randn(4)], [torch.randn(3)])
