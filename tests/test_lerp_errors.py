"""Bad input to fused_ema.lerp_ gets a clear error naming the index, the expected and the actual,
and the EMA tensors are bit-identical afterwards (every check runs before anything is written).
Each case is tried through the public function and through the raw torch.ops entry."""

import pytest
import torch

import fused_ema


def raw_op(ema, src, weight):
    """The dispatcher entry, overload named explicitly (the packet would turn a 0-dim int tensor
    into a float and pick the float overload)."""
    ops = torch.ops.fused_ema.lerp_
    overload = ops.Tensor if isinstance(weight, torch.Tensor) else ops.default
    overload(ema, src, weight)


ENTRIES = {"api": fused_ema.lerp_, "raw": raw_op}


@pytest.fixture(params=list(ENTRIES))
def lerp(request):
    return ENTRIES[request.param]


def good_lists(device, count=4, n=257):
    ema = [torch.randn(n, device=device) for _ in range(count)]
    src = [torch.randn(n, device=device) for _ in range(count)]
    return ema, src


def assert_rejected(lerp, ema, src, weight, error, match):
    """The call raises `error` matching `match`, and leaves every ema tensor as it was, its
    version counter included (autograd would see a bumped one as an in-place write)."""
    snapshot = [e.detach().clone() for e in ema]
    versions = [None if e.is_inference() else e._version for e in ema]
    with pytest.raises(error, match=match):
        lerp(ema, src, weight)
    for i, (e, s) in enumerate(zip(ema, snapshot)):
        assert torch.equal(e, s), f"ema[{i}] changed although the call was rejected"
    assert [None if e.is_inference() else e._version for e in ema] == versions


def test_length_mismatch(lerp, device):
    ema, src = good_lists(device)
    assert_rejected(lerp, ema, src[:3], 0.5, ValueError, r"ema has 4 tensors but src has 3")


def test_shape_mismatch_names_index_and_shapes(lerp, device):
    ema, src = good_lists(device)
    src[2] = torch.randn(16, 16, device=device)
    assert_rejected(
        lerp,
        ema,
        src,
        0.5,
        ValueError,
        r"src\[2\] has shape \[16, 16\] but ema\[2\] has shape \[257\]",
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("side", ["ema", "src"])
def test_integer_and_bool_dtypes(lerp, device, dtype, side):
    ema, src = good_lists(device)
    bad = torch.ones(257, dtype=dtype, device=device)
    (ema if side == "ema" else src)[3] = bad
    name = str(dtype).split(".")[-1]
    assert_rejected(lerp, ema, src, 0.5, ValueError, rf"{side}\[3\] has dtype {name}")


@pytest.mark.parametrize(
    "ema_dtype, src_dtype",
    [
        (torch.bfloat16, torch.float64),
        (torch.float16, torch.bfloat16),
        (torch.float64, torch.float32),
        (torch.float32, torch.float64),
        (torch.bfloat16, torch.float16),
    ],
)
def test_unsupported_dtype_pairs(lerp, device, ema_dtype, src_dtype):
    ema, src = good_lists(device)
    ema[1] = torch.randn(257, device=device).to(ema_dtype)
    src[1] = torch.randn(257, device=device).to(src_dtype)
    e, s = str(ema_dtype).split(".")[-1], str(src_dtype).split(".")[-1]
    assert_rejected(
        lerp, ema, src, 0.5, ValueError, rf"unsupported dtype pair at index 1: ema {e}, src {s}"
    )


def test_complex_dtype(lerp, device):
    ema, src = good_lists(device)
    ema[0] = torch.randn(257, dtype=torch.complex64, device=device)
    src[0] = torch.randn(257, dtype=torch.complex64, device=device)
    assert_rejected(lerp, ema, src, 0.5, ValueError, r"ema\[0\] has dtype complex64")


def test_overlapping_ema_tensors(lerp, device):
    base = torch.randn(1000, device=device)
    ema = [torch.randn(100, device=device), base[0:600], base[500:1000]]
    src = [
        torch.randn(100, device=device),
        torch.randn(600, device=device),
        torch.randn(500, device=device),
    ]
    assert_rejected(lerp, ema, src, 0.5, RuntimeError, r"ema\[1\] and ema\[2\] share memory")


def test_interleaved_ema_views_are_refused_as_overlapping_ranges(lerp, device):
    """t[0::2] and t[1::2] hold no element in common, but their address ranges overlap: the check
    compares ranges (docs/ops.md), and says so."""
    base = torch.randn(1000, device=device)
    ema = [base[0::2], base[1::2]]
    src = [torch.randn(500, device=device), torch.randn(500, device=device)]
    assert_rejected(
        lerp, ema, src, 0.5, RuntimeError, r"ema\[0\] and ema\[1\] share memory \(their address"
    )


def test_same_ema_tensor_twice(lerp, device):
    ema, src = good_lists(device)
    ema[3] = ema[0]
    assert_rejected(lerp, ema, src, 0.5, RuntimeError, r"ema\[0\] and ema\[3\] share memory")


def test_src_aliasing_its_ema(lerp, device):
    ema, src = good_lists(device)
    src[2] = ema[2]
    assert_rejected(lerp, ema, src, 0.5, RuntimeError, r"src\[2\] aliases ema\[2\]")


def test_src_view_overlapping_its_ema(lerp, device):
    base = torch.randn(600, device=device)
    ema, src = (
        [torch.randn(8, device=device), base[:300]],
        [torch.randn(8, device=device), base[200:500]],
    )
    assert_rejected(lerp, ema, src, 0.5, RuntimeError, r"src\[1\] aliases ema\[1\]")


def test_src_overlapping_another_ema(lerp, device):
    ema, src = good_lists(device)
    src[3] = ema[1]
    assert_rejected(lerp, ema, src, 0.5, RuntimeError, r"src\[3\] shares memory with ema\[1\]")


@pytest.mark.parametrize("keep", [0, 100])
def test_a_source_whose_storage_was_freed_or_shrunk_is_refused(lerp, device, keep):
    """resize_(0) is how FSDP frees a parameter's memory; torch's own ops read out of bounds."""
    ema, src = good_lists(device)
    src[1].untyped_storage().resize_(keep)
    match = rf"src\[1\]'s storage holds {keep} bytes but its elements need 1028 \(was it freed"
    assert_rejected(lerp, ema, src, 0.5, ValueError, match)


def test_an_ema_whose_storage_was_freed_is_refused_and_the_others_keep_their_values(lerp, device):
    ema, src = good_lists(device)
    view = torch.randn(300, device=device)[44:]  # its elements end at byte 1200 of its storage
    ema[3], src[3] = view, torch.randn(256, device=device)
    kept = [e.clone() for e in ema[:2]]
    view.untyped_storage().resize_(1196)
    with pytest.raises(
        ValueError, match=r"ema\[3\]'s storage holds 1196 bytes but its elements need 1200"
    ):
        lerp(ema, src, 0.5)
    ema[2].untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"ema\[2\]'s storage holds 0 bytes"):
        lerp(ema, src, 0.5)
    assert all(torch.equal(e, k) for e, k in zip(ema[:2], kept))


def test_lerp_many_and_bema_name_the_freed_tensor(device):
    emas = [[torch.randn(64, device=device) for _ in range(3)] for _ in range(2)]
    src = [torch.randn(64, device=device) for _ in range(3)]
    emas[1][2].untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"fused_ema.lerp_many_: emas\[1\]\[2\]'s storage"):
        fused_ema.lerp_many_(emas, src, [0.1, 0.01])
    theta0 = [torch.randn(64, device=device) for _ in range(3)]
    out = [torch.randn(64, device=device) for _ in range(3)]
    theta0[0].untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"fused_ema.bema_: theta0\[0\]'s storage holds 0"):
        fused_ema.bema_(emas[0], theta0, out, src, (0.1, 0.5, 0.25))


def test_expanded_ema_has_internal_overlap(lerp, device):
    ema, src = good_lists(device)
    ema[2] = torch.randn(1, device=device).expand(257)
    assert_rejected(
        lerp, ema, src, 0.5, RuntimeError, r"ema\[2\] has internally overlapping memory"
    )


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight(lerp, device, weight):
    ema, src = good_lists(device)
    assert_rejected(lerp, ema, src, weight, ValueError, r"weight must be finite")


@pytest.mark.parametrize("weight", [1e39, -3.5e38, torch.tensor(1e39, dtype=torch.float64)])
def test_weights_beyond_float32_are_refused_before_writing(lerp, device, weight):
    """The kernels of 32- and 16-bit EMAs compute in float32: 1e39 would be inf there."""
    ema, src = good_lists(device)
    assert_rejected(lerp, ema, src, weight, ValueError, "weight must fit a float32")
    emas = [[e.clone() for e in ema] for _ in range(2)]
    before = [[e.clone() for e in group] for group in emas]
    with pytest.raises(ValueError, match=r"weights\[1\] must fit a float32"):
        fused_ema.lerp_many_(emas, src, [0.5, 1e39])
    assert all(torch.equal(a, b) for g, h in zip(emas, before) for a, b in zip(g, h))


def test_int_weights_beyond_int64_are_checked_as_numbers(device):
    """An int is a weight like a float: 2**70 fits a float32, 2**1100 does not even fit a float64
    (the dispatcher's Scalar holds neither, so the API converts)."""
    ema, src = good_lists(device)
    expected = [e.clone() for e in ema]
    torch._foreach_lerp_(expected, src, float(2**70))
    fused_ema.lerp_(ema, src, 2**70)
    for got, want in zip(ema, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    for weight in (2**1100, -(2**1100)):
        assert_rejected(fused_ema.lerp_, ema, src, weight, ValueError, "weight must fit a float32")
    emas = [[e.clone() for e in ema] for _ in range(2)]
    for call, match in [
        (lambda: fused_ema.lerp_many_(emas, src, [0.5, 2**1100]), r"weights\[1\] must fit"),
        (lambda: fused_ema.bema_(*emas, emas[0], src, (0.5, 0.1, 2**1100)), r"\(alpha\) must fit"),
    ]:
        before = [[e.clone() for e in group] for group in emas]
        with pytest.raises(ValueError, match=match):
            call()
        assert all(torch.equal(a, b) for g, h in zip(emas, before) for a, b in zip(g, h))


def test_non_finite_cpu_tensor_weight(device):
    ema, src = good_lists(device)
    assert_rejected(
        fused_ema.lerp_, ema, src, torch.tensor(float("nan")), ValueError, "weight must be finite"
    )


@pytest.mark.parametrize(
    "weight, match",
    [
        (torch.tensor([0.1, 0.2]), r"one element .* got shape \[2\]"),
        (torch.tensor(1, dtype=torch.int64), r"float32 or float64, got int64"),
        (torch.tensor(0.5, dtype=torch.bfloat16), r"float32 or float64, got bfloat16"),
    ],
)
def test_bad_tensor_weight(lerp, device, weight, match):
    ema, src = good_lists(device)
    assert_rejected(lerp, ema, src, weight.to(device), ValueError, match)


@pytest.mark.parametrize("weight, name", [(True, "bool"), (False, "bool"), (1j, "complex")])
def test_bool_and_complex_weights_are_refused_on_both_routes(lerp, device, weight, name):
    # The op's schema keeps the Python type (Scalar), so True is not silently 1.0 on either route.
    ema, src = good_lists(device)
    match = rf"weight must be a float or a 0-dim tensor, got {name}"
    assert_rejected(lerp, ema, src, weight, TypeError, match)
    with pytest.raises(TypeError, match=match):
        lerp([], [], weight)


@pytest.mark.parametrize("weight", [0, 1, -2, 3])
def test_int_weights_are_accepted_on_both_routes(lerp, device, weight):
    ema, src = good_lists(device)
    expected = [e.clone() for e in ema]
    torch._foreach_lerp_(expected, src, float(weight))
    lerp(ema, src, weight)
    for got, want in zip(ema, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_weight_requiring_grad_under_grad_mode(lerp, device):
    ema, src = good_lists(device)
    weight = torch.tensor(0.25, device=device, requires_grad=True)
    assert_rejected(lerp, ema, src, weight, RuntimeError, r"weight requires grad")
    expected = [e.clone() for e in ema]
    torch._foreach_lerp_(expected, src, 0.25)
    with torch.no_grad():
        lerp(ema, src, weight)
    for got, want in zip(ema, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_scalar_overload_takes_no_tensor_weight(requires_grad):
    # With a `float` schema a 0-dim tensor was coerced through __float__, skipping the tensor
    # checks (requires grad, dtype); the Scalar schema refuses it.
    ema, src = good_lists("cpu")
    weight = torch.tensor(0.5, requires_grad=requires_grad)
    op = torch.ops.fused_ema.lerp_.default
    assert_rejected(op, ema, src, weight, RuntimeError, r"Expected a value of type 'number'")


META = "meta tensors hold no data"


@pytest.mark.parametrize("weight_kind", ["float", "tensor"])
def test_meta_lists_are_refused(lerp, weight_kind):
    ema = [torch.empty(5, device="meta"), torch.empty(2, 3, device="meta")]
    src = [torch.empty(5, device="meta"), torch.empty(2, 3, device="meta")]
    weight = 0.5 if weight_kind == "float" else torch.tensor(0.5, device="meta")
    with pytest.raises(RuntimeError, match=META):
        lerp(ema, src, weight)


def test_meta_weight_is_refused(lerp):
    ema, src = good_lists("cpu")
    assert_rejected(lerp, ema, src, torch.tensor(0.5, device="meta"), RuntimeError, META)
    with pytest.raises(RuntimeError, match=META):
        lerp([], [], torch.tensor(0.5, device="meta"))


def test_fake_tensors_still_trace():
    # FakeTensorMode (what torch.compile traces with) uses the fake kernels, which only refuse
    # tensors that really are on the meta device.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ema, src = good_lists("cpu")
        fused_ema.lerp_(ema, src, 0.5)
        fused_ema.lerp_(ema, src, torch.tensor(0.5))


@pytest.mark.parametrize("weight", ["0.5", None, [0.5]])
def test_weight_of_wrong_type(device, weight):
    ema, src = good_lists(device)
    assert_rejected(fused_ema.lerp_, ema, src, weight, TypeError, "weight must be a float")


def test_tensor_instead_of_list():
    ema, src = good_lists("cpu")
    with pytest.raises(TypeError, match="sequence of tensors, not a tensor"):
        fused_ema.lerp_(ema[0], src[0], 0.5)


def test_ema_requiring_grad_under_grad_mode(lerp, device):
    ema, src = good_lists(device)
    ema[1] = torch.nn.Parameter(ema[1])
    assert_rejected(lerp, ema, src, 0.5, RuntimeError, r"ema\[1\] requires grad")
    with torch.no_grad():  # the way EMA updates run
        lerp(ema, src, 0.5)


def test_src_requiring_grad_is_fine(lerp, device):
    ema, src = good_lists(device)
    src = [torch.nn.Parameter(s) for s in src]
    expected = [e.clone() for e in ema]
    torch._foreach_lerp_(expected, [s.detach() for s in src], 0.5)
    lerp(ema, src, 0.5)
    for a, b in zip(ema, expected):
        assert torch.equal(a, b)


def test_inference_tensor_outside_inference_mode(lerp, device):
    ema, src = good_lists(device)
    with torch.inference_mode():
        ema[2] = torch.randn(257, device=device)
    assert_rejected(lerp, ema, src, 0.5, RuntimeError, r"ema\[2\] is an inference tensor")


def test_sparse_tensor(lerp):
    ema, src = good_lists("cpu")
    ema[1] = torch.randn(257).to_sparse()
    with pytest.raises((ValueError, RuntimeError, NotImplementedError)):
        lerp(ema, src, 0.5)


def test_device_mismatch_within_pair_names_both_devices(lerp):
    # A meta src stands in for a second device on CPU-only machines.
    ema, src = good_lists("cpu")
    src[2] = torch.randn(257, device="meta")
    assert_rejected(
        lerp, ema, src, 0.5, RuntimeError, r"src\[2\] is on meta but ema\[2\] is on cpu"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cpu_pair_names_both_devices(lerp):
    ema, src = good_lists("cuda")
    src[1] = src[1].cpu()
    assert_rejected(
        lerp, ema, src, 0.5, RuntimeError, r"src\[1\] is on cpu but ema\[1\] is on cuda:0"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_weight_for_cpu_ema_is_refused(lerp):
    ema, src = good_lists("cpu")
    weight = torch.tensor(0.5, device="cuda")
    assert_rejected(lerp, ema, src, weight, RuntimeError, r"weight is on cuda:0")


def test_empty_lists_are_a_no_op(lerp):
    lerp([], [], 0.5)
    lerp([], [], torch.tensor(0.5))


def test_lists_seen_before_are_checked_again_when_they_change(lerp):
    # The overlap check remembers the last lists it cleared; a changed list must not slip by.
    ema, src = good_lists("cpu")
    lerp(ema, src, 0.5)
    lerp(ema, src, 0.5)
    aliased = list(src)
    aliased[3] = ema[1]
    assert_rejected(lerp, ema, aliased, 0.5, RuntimeError, r"src\[3\] shares memory with ema\[1\]")
    assert_rejected(lerp, ema, aliased, 0.5, RuntimeError, r"src\[3\] shares memory with ema\[1\]")


def _bad_calls():
    """Bad calls of every writing op, as (name, build): build() makes fresh random arguments."""
    t = torch.randn
    ops = torch.ops.fused_ema
    step, w = torch.tensor(3), torch.tensor(0.5)
    return {
        "shape": lambda: (ops.lerp_.default, [t(4, 3)], [t(3, 4)], 0.5),
        "dtype pair": lambda: (ops.lerp_.Tensor, [t(5).bfloat16()], [t(5).half()], w),
        "stride-0 ema": lambda: (ops.lerp_.default, [t(1).expand(6)], [t(6)], 0.5),
        "weight dtype": lambda: (ops.lerp_.Tensor, [t(5)], [t(5)], torch.tensor(1)),
        "keys": lambda: (
            ops.lerp_stochastic_.default,
            [t(5).bfloat16()],
            [t(5)],
            w,
            step,
            1,
            [0, 1],
            [0],
        ),
        "key range": lambda: (
            ops.lerp_stochastic_.default,
            [t(5).bfloat16()],
            [t(5)],
            w,
            step,
            1,
            [-1],
            [0],
        ),
        "tracks": lambda: (ops.lerp_many_.default, [t(5), t(5), t(5)], [t(5)], t(2)),
        "track shape": lambda: (ops.lerp_many_.default, [t(5), t(4)], [t(5)], t(2)),
        "seeds": lambda: (
            ops.lerp_many_stochastic_.default,
            [t(5).half()],
            [t(5)],
            t(1),
            step,
            [1, 2],
            [0],
            [0],
        ),
        "bema dtype": lambda: (ops.bema_.default, [t(5)], [t(5).double()], [t(5)], [t(5)], t(3)),
        "bema lists": lambda: (ops.bema_.default, [t(5)], [], [t(5)], [t(5)], t(3)),
        "schedule": lambda: (ops.ema_schedule_.default, step, t(2), t(12).double(), True),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_fake_kernels_refuse_as_the_op_does(case):
    """Traced (FakeTensorMode, what torch.compile runs) a bad call fails with the error the eager
    op gives: the fake kernels run the C++ checks themselves, not a copy of them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, *args = _bad_calls()[case]()
    with pytest.raises(Exception) as eager:
        op(*args)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
        with pytest.raises(Exception) as traced:
            op(*fake)
    assert type(traced.value) is type(eager.value)
    assert str(traced.value).splitlines()[0] == str(eager.value).splitlines()[0]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e, s: fused_ema.lerp_([e, None], [s, s], 0.1), r"lerp_: ema\[1\] must be a tensor"),
        (
            lambda e, s: fused_ema.lerp_stochastic_([e.bfloat16()], [3], 0.1, seed=1, step=1),
            r"lerp_stochastic_: src\[0\] must be a tensor, got int",
        ),
        (
            lambda e, s: fused_ema.lerp_many_([[e], ["x"]], [s], [0.1, 0.2]),
            r"lerp_many_: emas\[1\]\[0\] must be a tensor, got str",
        ),
        (
            lambda e, s: fused_ema.bema_([e], [e.clone()], [None], [s], [0.1, 0.1, 0.1]),
            r"bema_: out\[0\] must be a tensor, got NoneType",
        ),
    ],
)
def test_a_list_item_that_is_no_tensor_is_named(call, message):
    """The schema's own error names neither the list nor the index; the Python API does."""
    ema, src = torch.randn(7), torch.randn(7)
    before = ema.clone()
    with pytest.raises(TypeError, match=message):
        call(ema, src)
    assert torch.equal(ema, before) and ema._version == 0


def test_dtensor_pairing_errors_name_the_op_and_the_list():
    """A DTensor beside a plain tensor: the error named fused_ema.lerp_ and ema[i] whatever the op
    and list (lerp_many_'s emas[k][i], bema_'s theta0[i] and out[i])."""
    dist = pytest.importorskip("torch.distributed")
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))

        def shard(t):
            return tensor_api.DTensor.from_local(
                t, mesh, [tensor_api.Shard(0)], run_check=False, shape=(12,), stride=(1,)
            )

        src = [torch.randn(8), shard(torch.randn(3))]
        sharded = [torch.randn(8), shard(torch.randn(3))]
        plain = [torch.randn(8), torch.randn(3)]
        before = [t.clone() for t in plain]
        calls = {
            r"fused_ema.lerp_many_: src\[1\] is a DTensor but emas\[1\]\[1\]": lambda: (
                fused_ema.lerp_many_([sharded, plain], src, [0.1, 0.2])
            ),
            r"fused_ema.bema_: src\[1\] is a DTensor but out\[1\]": lambda: fused_ema.bema_(
                sharded, [torch.randn(8), shard(torch.randn(3))], plain, src, (0.1, 0.2, 0.3)
            ),
            r"fused_ema.lerp_stochastic_: src\[1\] is a DTensor but ema\[1\]": lambda: (
                fused_ema.lerp_stochastic_([t.bfloat16() for t in plain], src, 0.1, seed=0, step=0)
            ),
        }
        for message, call in calls.items():
            with pytest.raises(ValueError, match=message):
                call()
        assert all(torch.equal(a, b) for a, b in zip(plain, before))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("what", ["freed", "shrunk"])
def test_a_weight_or_step_tensor_without_its_memory_is_refused_by_name(what):
    """The weights and step tensors' storage was not checked: a shrunk one was read past its end
    (heap garbage used as the weight), a freed one gave torch's message naming nothing."""

    def without_memory(t):
        t.untyped_storage().resize_(0 if what == "freed" else 4)
        return t

    src = [torch.randn(5)]
    emas = [[torch.randn(5)], [torch.randn(5)]]
    before = [t[0].clone() for t in emas]
    weights = without_memory(torch.tensor([0.25] * 64, dtype=torch.float32)[60:62])
    with pytest.raises(ValueError, match=r"lerp_many_: weights's storage holds \d+ bytes"):
        fused_ema.lerp_many_(emas, src, weights)
    weight = without_memory(torch.tensor([0.0, 0.0, 0.1], dtype=torch.float64)[2])
    with pytest.raises(ValueError, match=r"lerp_: weight's storage holds"):
        fused_ema.lerp_(emas[0], src, weight)
    step = without_memory(torch.tensor([0, 0, 3])[2])
    bf16 = [torch.randn(5).bfloat16()]
    with pytest.raises(ValueError, match=r"lerp_stochastic_: step's storage holds"):
        fused_ema.lerp_stochastic_(bf16, src, 0.1, seed=0, step=step)
    assert all(torch.equal(t[0], b) for t, b in zip(emas, before))
