"""swap_values_, the one call of each direction of ModelEma.swapped(): pairs exchange their values
exactly, through scratch buffers of any size, strided or not; a repeated call does nothing; a bad
pair is refused before anything is written."""

import pytest
import torch

swap_values_ = torch.ops.fused_ema.swap_values_
# The op is on torch's stable ABI, where a kernel's std::invalid_argument reaches Python as
# ValueError under torch 2.11-2.13 and as RuntimeError under 2.15 (csrc/swap_values.cpp).
REFUSED = (ValueError, RuntimeError)


def _pairs(seed: int):
    g = torch.Generator().manual_seed(seed)
    a = [
        torch.randn(7, 5, generator=g),
        torch.randn(3, 4, generator=g).t(),  # strided
        torch.randn((), generator=g),
        torch.randn(1000, generator=g).to(torch.bfloat16),
        torch.empty(0, 3),
    ]
    b = [torch.randn(t.shape, generator=g).to(t.dtype) for t in a]
    return a, b


@pytest.mark.parametrize("chunk", [1, 3, 16, 4096])
def test_pairs_exchange_their_values_exactly(chunk):
    a, b = _pairs(chunk)
    was_a, was_b = [t.clone() for t in a], [t.clone() for t in b]
    scratch = [torch.empty(max(chunk, 4)), torch.empty(chunk, dtype=torch.bfloat16)]
    state = torch.zeros((), dtype=torch.int64)
    swap_values_(a, b, scratch, state, 1)
    assert state.item() == 1
    for x, y, wx, wy in zip(a, b, was_a, was_b):
        assert torch.equal(x, wy) and torch.equal(y, wx)
    swap_values_(a, b, scratch, state, 1)  # a repeat, as after an interrupt: nothing more
    assert all(torch.equal(x, wy) for x, wy in zip(a, was_b))
    swap_values_(a[::-1], b[::-1], scratch, state, 0)
    assert state.item() == 0
    for x, y, wx, wy in zip(a, b, was_a, was_b):
        assert torch.equal(x, wx) and torch.equal(y, wy)


def test_exchanges_in_order_undo_in_reverse_over_shared_memory():
    storage = torch.randn(10)
    a = [storage[:6], storage[4:]]
    b = [torch.randn(6), torch.randn(6)]
    was, want = storage.clone(), [t.clone() for t in b]
    state, scratch = torch.zeros((), dtype=torch.int64), [torch.empty(4)]
    swap_values_(a, b, scratch, state, 1)
    assert torch.equal(storage[4:], want[1]) and torch.equal(storage[:4], want[0][:4])
    swap_values_(a[::-1], b[::-1], scratch, state, 0)
    assert torch.equal(storage, was)


@pytest.mark.parametrize("bad", ["dtype", "shape", "overlap"])
def test_a_bad_pair_is_refused_before_any_write(bad):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(40, generator=g)
    a = [torch.randn(4, generator=g), base[:35].view(7, 5)]
    b = [torch.randn(4, generator=g), torch.randn(7, 5, generator=g)]
    if bad == "dtype":
        b[1], match = b[1].double(), r"pair 1: Float\[7, 5\] on cpu .* Double\[7, 5\]"
    elif bad == "shape":
        b[1], match = b[1].t(), r"pair 1: Float\[7, 5\] on cpu .* Float\[5, 7\]"
    else:
        b[1], match = base[5:].view(7, 5), "pair 1: the two tensors overlap in memory"
    was = [t.clone() for t in (*a, b[0], base)]
    state = torch.zeros((), dtype=torch.int64)
    with pytest.raises(REFUSED, match=match):
        swap_values_(a, b, [torch.empty(8)], state, 1)
    assert all(torch.equal(t, w) for t, w in zip((*a, b[0], base), was)) and state.item() == 0


def test_a_pair_without_its_scratch_buffer_is_refused_before_any_write():
    a = [torch.randn(4), torch.randn(3, dtype=torch.float64)]
    b = [torch.randn(4), torch.randn(3, dtype=torch.float64)]
    was = [t.clone() for t in a]
    state = torch.zeros((), dtype=torch.int64)
    with pytest.raises(REFUSED, match="no scratch buffer of Double on cpu for pair 1"):
        swap_values_(a, b, [torch.empty(4)], state, 1)
    assert all(torch.equal(t, w) for t, w in zip(a, was)) and state.item() == 0
