"""The prepared update (csrc/prepared_update.h, fused_ema/_update/prepared.py): a blocking update's
plan held in the extension and run again by one call while every tensor is what was planned. Each
test checks the EMA against an independent float64 reference of the updates applied, including
when the model's or the EMA's tensors change under the plan (.data swaps, resize_, dtype)."""

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from track_helpers import fused_passes

import fused_ema
from ema_helpers import TiedNet, small_mlp, train_step
from fused_ema import _C

DECAY = 0.75


class Reference:
    """float64 EMA of a model's float tensors by name: copy first, then lerp with 1 - decay."""

    def __init__(self):
        self.values = None

    def update(self, model):
        state = model.state_dict()
        if self.values is None:
            self.values = {k: v.detach().double().clone() for k, v in state.items()}
            return
        for name, value in state.items():
            if value.is_floating_point():
                self.values[name] += (1 - DECAY) * (value.detach().double() - self.values[name])
            else:
                self.values[name] = value.detach().double().clone()

    def check(self, ema, atol=1e-5):
        weights = ema.state_dict()["weights"]
        for name, value in self.values.items():
            if name in weights:
                torch.testing.assert_close(weights[name].double(), value, rtol=0, atol=atol)


def perturb(model, g):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def updated_pair(model):
    ema, ref = fused_ema.ModelEma(model, decay=DECAY), Reference()
    for _ in range(3):
        ema.update(model)
        ref.update(model)
    return ema, ref


def test_a_steady_update_is_one_fused_pass_and_matches_float64():
    g = torch.Generator().manual_seed(0)
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema, ref = fused_ema.ModelEma(model, decay=DECAY), Reference()

    def steps():
        for _ in range(4):
            train_step(model, optimizer, g)
            ema.update(model)
            ref.update(model)

    assert fused_passes(steps) == ["lerp_"] * 4
    assert ema._updater.prepared is not None
    ref.check(ema)


def test_a_data_swap_of_the_same_shape_is_followed():
    g = torch.Generator().manual_seed(1)
    model = small_mlp()
    ema, ref = updated_pair(model)
    with torch.no_grad():
        model[0].weight.data = torch.randn(model[0].weight.shape, generator=g)  # new storage
    for _ in range(2):
        perturb(model, g)
        ema.update(model)
        ref.update(model)
    ref.check(ema)


@pytest.mark.parametrize("change", ["resize_", "view", "dtype"])
def test_a_reshaped_or_retyped_tensor_is_a_structure_change(change):
    g = torch.Generator().manual_seed(2)
    model = small_mlp()
    ema, _ = updated_pair(model)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    mean = model[1].running_mean  # a buffer: resize_ needs no grad mode games
    if change == "resize_":
        mean.resize_(mean.numel() + 4)
    elif change == "view":
        mean.data = mean.data.reshape(4, -1)
    else:
        mean.data = mean.data.double()
    perturb(model, g)
    if change == "dtype":  # a float64 source of a float32 EMA: staged, still averaged
        ema.update(model)
        after = ema.state_dict()["weights"]["1.running_mean"].double()
        expected = before["1.running_mean"].double().lerp(mean.double(), 1 - DECAY)
        torch.testing.assert_close(after, expected, rtol=0, atol=1e-6)
        return
    with pytest.raises(fused_ema.StructureMismatchError, match="1.running_mean"):
        ema.update(model)
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name]), name
    assert ema.step == 3


def test_an_ema_tensor_swapped_through_ema_module_is_written_where_it_now_lies():
    g = torch.Generator().manual_seed(3)
    model = small_mlp()
    ema, ref = updated_pair(model)
    replacement = torch.randn(ema.module[0].bias.shape, generator=g)
    ema.module[0].bias.data = replacement
    ref.values["0.bias"] = replacement.double().clone()
    perturb(model, g)
    ema.update(model)
    ref.update(model)
    ref.check(ema)
    assert ema.module[0].bias.data_ptr() == replacement.data_ptr()


def test_a_non_contiguous_source_is_averaged_every_step():
    g = torch.Generator().manual_seed(4)
    model = nn.Linear(5, 3)
    model.weight = nn.Parameter(torch.randn(5, 3, generator=g).t())  # a transposed view
    ema, ref = updated_pair(model)
    for _ in range(3):
        perturb(model, g)
        ema.update(model)
        ref.update(model)
    ref.check(ema)


def test_a_dispatch_mode_sees_the_fused_op():
    model = small_mlp()
    ema, _ = updated_pair(model)
    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recording():
        ema.update(model)
    assert any("fused_ema.lerp_" in name for name in seen), seen


def test_the_prepared_update_is_freed_with_the_ema_and_keeps_no_model_alive():
    model = small_mlp()
    ema, _ = updated_pair(model)
    handle = ema._updater.prepared.handle
    assert _C.prepared_runs(handle) >= 2
    model_ref = weakref.ref(model)
    del ema, model
    gc.collect()
    assert _C.prepared_runs(handle) == -1
    assert model_ref() is None


def test_a_stale_plan_is_replaced_when_the_model_changes_structure():
    g = torch.Generator().manual_seed(5)
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=DECAY, on_mismatch="resync")
    ema.update(model)
    ema.update(model)
    first = ema._updater.prepared
    model[3] = nn.Linear(16, 5)  # reshaped: it starts from the model
    perturb(model, g)
    ema.update(model)
    assert ema._updater.prepared is not first
    torch.testing.assert_close(ema.state_dict()["weights"]["3.weight"], model[3].weight.detach())
    perturb(model, g)
    expected = ema.state_dict()["weights"]["3.weight"].lerp(model[3].weight.detach(), 1 - DECAY)
    ema.update(model)
    torch.testing.assert_close(ema.state_dict()["weights"]["3.weight"], expected)


def test_the_models_tensors_are_freed_with_the_model_while_the_ema_lives():
    model = small_mlp()
    ema, _ = updated_pair(model)
    weights = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    handle = ema._updater.prepared.handle
    param = weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert param() is None  # the prepared update held it: it went with the model
    assert _C.prepared_runs(handle) == -1
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, weights[name]), name
    other = small_mlp()
    ema.resync(other)
    ema.update(other)  # a new model, a new prepared update
    assert ema._updater.prepared.handle != handle


def test_a_refusal_inside_the_prepared_call_changes_nothing():
    g = torch.Generator().manual_seed(6)
    model = small_mlp()
    ema, _ = updated_pair(model)
    bias = ema.module[3].bias
    good = bias.data
    bias.data = good.to(torch.int32)  # an EMA tensor the fused kernels refuse
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    perturb(model, g)
    with pytest.raises((RuntimeError, ValueError, TypeError), match="ema"):
        ema.update(model)
    assert ema.step == 3
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name]), name
    bias.data = good
    ema.update(model)  # and it goes on from there
    assert ema.step == 4


def test_dtensor_shards_are_prepared_and_a_swapped_local_shard_is_followed():
    """A model of Shard(0) DTensors (a fake 2-rank group, this rank 0) is averaged by the prepared
    update, shard by shard, against a float64 reference of the local shards; replacing a DTensor's
    _local_tensor (which only Python sees) makes the next update average the new shard."""
    dist = pytest.importorskip("torch.distributed")
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(21)

        def shard(rows: int, full: tuple) -> nn.Parameter:
            local = torch.randn(rows, full[1], generator=g)
            dt = tensor_api.DTensor.from_local(
                local, mesh, [tensor_api.Shard(0)], run_check=False, shape=full, stride=(full[1], 1)
            )
            return nn.Parameter(dt)

        model = nn.Module()
        model.a, model.b = shard(4, (7, 3)), shard(2, (4, 5))
        ema, want = fused_ema.ModelEma(model, decay=DECAY), {}

        def step():  # as Reference: the first update copies, the next ones lerp
            with torch.no_grad():
                for p in model.parameters():
                    p._local_tensor.add_(torch.randn(p._local_tensor.shape, generator=g))
            ema.update(model)
            for n, p in model.named_parameters():
                value = p._local_tensor.double()
                want[n] = (
                    value.clone() if n not in want else want[n] + (1 - DECAY) * (value - want[n])
                )

        for _ in range(3):
            step()
        prepared = ema._updater.prepared
        assert prepared is not None and prepared.shards
        step()
        assert ema._updater.prepared is prepared  # the steady state: the same prepared update
        model.a._local_tensor = torch.randn(4, 3, generator=g)  # a new local shard
        step()
        assert ema._updater.prepared is not prepared
        got = ema.state_dict()["weights"]
        for n in want:
            torch.testing.assert_close(got[n]._local_tensor.double(), want[n], rtol=0, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_shard_rows_are_prepared_and_a_data_swap_is_followed():
    """ModelEma(shard=True) of a replicated model (a fake 2-rank group, this rank 0) averages its
    rows by the prepared update, bit for bit as an unsharded twin does those rows; a `.data =` swap
    (same shape: only the memory moves) makes the next update average the new values."""
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from fused_ema._dist.dtensor import replica_cut

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        g = torch.Generator().manual_seed(22)
        model = small_mlp()
        ema = fused_ema.ModelEma(model, decay=DECAY, shard=True)
        twin = fused_ema.ModelEma(model, decay=DECAY)

        def step():
            perturb(model, g)
            ema.update(model)
            twin.update(model)

        def assert_rows_match():
            whole = twin.state_dict()["weights"]
            tensors = model.state_dict(keep_vars=True)
            for entry in ema._updater.binding.table.entries:
                cut = replica_cut(entry.ema, tensors[entry.name])
                if cut is None:  # kept whole (a scalar buffer)
                    assert torch.equal(entry.ema, whole[entry.name]), entry.name
                    continue
                dim, start, length = cut
                rows = whole[entry.name].narrow(dim, start, length)
                assert torch.equal(entry.ema._local_tensor, rows), entry.name

        for _ in range(3):
            step()
        prepared = ema._updater.prepared
        assert prepared is not None and prepared.cuts
        step()
        assert ema._updater.prepared is prepared
        assert_rows_match()
        with torch.no_grad():
            model[0].weight.data = torch.randn(model[0].weight.shape, generator=g)  # new memory
        step()
        assert ema._updater.prepared is not prepared
        assert_rows_match()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("every", [1, 3])
def test_staged_sources_are_copied_and_averaged_by_the_prepared_update(every):
    """A float64 model with a float32 EMA has no kernel for its pair: each source is copied into a
    float32 staging buffer first. The prepared update makes those copies itself, inside its one
    call, skips them on the steps update_every leaves out (weight 0), and follows a .data swap of
    a staged source. The EMA is checked against float64 lerps with the weight of each step."""
    g = torch.Generator().manual_seed(11)
    model = small_mlp().double()
    ema = fused_ema.ModelEma(model, decay=DECAY, dtype=torch.float32, update_every=every)
    ema.update(model)  # the first update copies the model
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    group = next(iter(ema._updater.binding.plan.groups.values()))
    assert group.staging, "the float64 sources should be staged"

    def steps(count):
        for _ in range(count):
            perturb(model, g)
            ema.update(model)
            weight = float(ema._updater.schedule.weight)
            for name, value in model.state_dict().items():
                if value.is_floating_point():
                    ref[name] += weight * (value.detach() - ref[name])

    prepared = ema._updater.prepared
    assert prepared is not None, "a staged update should be prepared"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        steps(2 * every)
    copies = [e for e in prof.events() if e.name == "aten::copy_"]
    assert len(copies) == 2 * len(group.staging)  # two steps kept, none copied on skipped ones
    assert ema._updater.prepared is prepared and prepared.runs() == 1 + 2 * every
    model[0].weight.data = model[0].weight.data.clone()  # a staged source, swapped
    steps(every)
    weights = ema.state_dict()["weights"]
    for name, value in ref.items():
        if value.is_floating_point():
            torch.testing.assert_close(weights[name].double(), value, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "layout, model_dtype, ema_dtype",
    [
        ("transposed", torch.float32, torch.float64),
        ("channels_last", torch.float64, torch.float32),
        ("transposed", torch.bfloat16, torch.float16),
        ("channels_last", torch.float16, torch.bfloat16),
    ],
)
def test_staged_sources_laid_out_unlike_their_staging_are_read_as_they_are_now(
    layout, model_dtype, ema_dtype
):
    """A staged source whose EMA is permuted (a transposed or channels_last weight) is laid out as
    its EMA in a stand-in: filled when the update runs, after the staging copy, not when it is
    planned (which read the staging buffer of the step before, or uninitialised memory)."""
    g = torch.Generator().manual_seed(5)
    model = nn.Module()
    if layout == "transposed":
        model.w = nn.Parameter(torch.randn(6, 5, generator=g).to(model_dtype).t())
    else:
        weight = torch.randn(4, 3, 5, 5, generator=g).to(model_dtype)
        model.w = nn.Parameter(weight.to(memory_format=torch.channels_last))
    model.b = nn.Parameter(torch.randn(7, generator=g).to(model_dtype))
    ema = fused_ema.ModelEma(model, decay=DECAY, dtype=ema_dtype)
    assert not ema.module.w.is_contiguous()
    ref, atol = None, 1e-6 if ema_dtype in (torch.float32, torch.float64) else 0.05
    for _ in range(4):
        ema.update(model)
        values = {k: v.detach().double() for k, v in model.state_dict().items()}
        if ref is None:
            ref = {k: v.to(ema_dtype).double() for k, v in values.items()}
        else:
            ref = {k: r + (1 - DECAY) * (values[k] - r) for k, r in ref.items()}
        weights = ema.state_dict()["weights"]
        for name, value in ref.items():
            torch.testing.assert_close(weights[name].double(), value, rtol=0.01, atol=atol)
        perturb(model, g)
    assert ema._updater.prepared is not None
