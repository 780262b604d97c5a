"""Structure changes are found by name, never paired by position: added, removed, reshaped and
replaced tensors raise one error listing them all (on_mismatch="error") or are followed
("resync"). swapped() and copy_to() match by name and restore even when the block raises."""

import copy
import pickle

import pytest
import torch
from torch import nn

import fused_ema
from ema_helpers import small_mlp, trained


def snapshot(ema):
    return {k: v.clone() for k, v in ema.state_dict()["weights"].items()}


def assert_unchanged(ema, before):
    after = ema.state_dict()["weights"]
    assert set(after) == set(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)


def test_error_lists_every_added_removed_reshaped_and_replaced_name():
    model = Net()
    ema = fused_ema.ModelEma(model, decay=0.9)
    ema.update(model)
    before, step = snapshot(ema), ema.step
    model.stem = nn.Linear(6, 16)  # replaced, same shape
    model.head = nn.Linear(16, 7)  # reshaped
    model.extra = nn.Linear(7, 2)  # added
    del model.norm  # removed, with its buffers
    with pytest.raises(fused_ema.StructureMismatchError) as info:
        ema.update(model)
    err = info.value
    assert set(err.added) == {"extra.weight", "extra.bias"}
    assert set(err.removed) == {
        "norm.weight",
        "norm.bias",
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    }
    assert [r.split(" ")[0] for r in err.reshaped] == ["head.weight", "head.bias"]
    assert set(err.replaced) == {"stem.weight", "stem.bias"}
    assert "resync" in str(err)
    assert_unchanged(ema, before)
    assert ema.step == step


@pytest.mark.parametrize("how", ["update", "resync"])
def test_inserted_module_keeps_every_tensors_own_average(how):
    # Pairing by position, or by name, would average the new layer into the old one's EMA.
    torch.manual_seed(1)
    model = trained(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)), 3)
    ema = fused_ema.ModelEma(model, decay=0.5, on_mismatch="resync")
    ema.update(model)
    trained(model, 1, seed=5)
    ema.update(model)  # the EMA now differs from the model
    averages = {name: value.clone() for name, value in ema.state_dict()["weights"].items()}
    inserted = nn.Linear(4, 4)
    model.insert(1, inserted)  # the old "1" becomes "2", the old "2" becomes "3"
    if how == "resync":
        ema.resync(model)
    else:
        ema.update(model)
    assert ema.names() == [f"{i}.{p}" for i in range(4) for p in ("weight", "bias")]
    weights = ema.state_dict()["weights"]
    moved = {"0": "0", "2": "1", "3": "2"}  # new name -> old name
    for new, old in moved.items():
        for p in ("weight", "bias"):
            before = averages[f"{old}.{p}"]
            current = getattr(model[int(new)], p).detach()
            expected = before if how == "resync" else before + 0.5 * (current - before)
            torch.testing.assert_close(weights[f"{new}.{p}"], expected, rtol=0, atol=0)
    # only the inserted layer starts from the model
    assert torch.equal(weights["1.weight"], inserted.weight)
    assert torch.equal(weights["1.bias"], inserted.bias)


def test_renamed_module_keeps_its_average_and_error_mode_names_it():
    torch.manual_seed(4)
    model = nn.Module()
    model.add_module("body", nn.Linear(3, 3))
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    with torch.no_grad():
        model.body.weight.add_(1.0)
    ema.update(model)
    average = ema.state_dict()["weights"]["body.weight"].clone()
    model.add_module("trunk", model._modules.pop("body"))
    with pytest.raises(fused_ema.StructureMismatchError, match="body.weight -> trunk.weight"):
        ema.update(model)
    assert torch.equal(ema.state_dict()["weights"]["body.weight"], average)
    ema.resync(model)
    assert torch.equal(ema.state_dict()["weights"]["trunk.weight"], average)


def test_none_module_and_none_parameter_do_not_break_updates():
    model = small_mlp()
    model.register_module("gone", None)
    model[0].register_parameter("extra", None)
    model[1].register_buffer("nothing", None)
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    ema.update(model)
    assert "gone" not in " ".join(ema.names()) and ema.step == 2


def test_complex_parameters_are_refused_at_construction_and_complex_buffers_copied():
    model = small_mlp()
    model.register_parameter("phase", nn.Parameter(torch.randn(3, dtype=torch.complex64)))
    with pytest.raises(ValueError, match="phase is torch.complex64"):
        fused_ema.ModelEma(model)
    model = small_mlp()
    model.register_buffer("freqs", torch.randn(4, dtype=torch.complex64))
    ema = fused_ema.ModelEma(model, decay=0.5)
    with torch.no_grad():
        model.freqs.mul_(2)
    ema.update(model)
    ema.update(model)
    assert torch.equal(ema.state_dict()["weights"]["freqs"], model.freqs)


def test_sparse_tensors_are_refused_by_name_and_can_be_left_out():
    """A sparse buffer (a graph's adjacency) was accepted, then every update failed naming a list
    index; now refused when the EMA meets it (built or resynced), and ignore_names leaves it."""
    torch.manual_seed(12)
    model = small_mlp()
    adjacency = torch.randn(5, 5) * (torch.rand(5, 5) > 0.5)
    model.register_buffer("adj", adjacency.to_sparse())
    with pytest.raises(ValueError, match=r"buffer adj is a torch.sparse_coo tensor.*ignore_names"):
        fused_ema.ModelEma(model)
    ema = fused_ema.ModelEma(model, decay=0.5, ignore_names=["adj"])
    ema.update(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    expected = model[0].weight.detach() - 0.5  # halfway from the step-1 copy
    torch.testing.assert_close(ema.state_dict()["weights"]["0.weight"], expected)
    with ema.swapped(model):
        pass
    grown = fused_ema.ModelEma(small_mlp(), decay=0.5, on_mismatch="resync")
    grown_model = small_mlp()
    grown_model.register_buffer("adj", adjacency.to_sparse())
    with pytest.raises(ValueError, match="buffer adj is a torch.sparse_coo tensor"):
        grown.update(grown_model)
    assert grown.step == 0
    # A buffer the EMA holds, replaced by a sparse one of its shape (followed, not made anew): an
    # update failed naming a list index, and resync() took it.
    replaced = small_mlp()
    ema = fused_ema.ModelEma(replaced, decay=0.5)
    ema.update(replaced)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    replaced[1].running_mean = replaced[1].running_mean.to_sparse()
    for call in (ema.update, ema.resync):
        with pytest.raises(ValueError, match=r"buffer 1.running_mean is a torch.sparse_coo tensor"):
            call(replaced)
    assert ema.step == 1
    assert all(torch.equal(v, ema.state_dict()["weights"][k]) for k, v in before.items())


def test_lazy_modules_are_refused_until_materialized_by_name():
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"param 0\.weight is uninitialized .*forward pass"):
        fused_ema.ModelEma(model, decay=0.5)
    model(torch.randn(3, 5))
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)  # the first step copies the model
    start = {k: v.double() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update(model)
    for name, value in model.state_dict().items():
        expected = 0.5 * start[name] + 0.5 * value.double()
        torch.testing.assert_close(ema.module.state_dict()[name].double(), expected)


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_a_module_under_several_names_loads_every_state_dict_it_makes(kind):
    torch.manual_seed(4)
    block = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    if kind == "dict":
        model = nn.ModuleDict({"enc": block, "dec": block})
    else:
        model = nn.Sequential(nn.Linear(3, 3), nn.ModuleList([block] * 3))
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    assert set(ema.names()) == set(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    saved = {k: v.clone() for k, v in ema.module.state_dict().items()}
    for state in (
        model.state_dict(),
        {"state_dict_ema": model.state_dict()},  # timm's training checkpoint
        saved,
    ):
        ema.load_state_dict(state)
        for name, value in ema.module.state_dict().items():
            assert torch.equal(value, state.get("state_dict_ema", state)[name]), name
    ema.update(model)
    expected = 0.5 * saved["1.0.0.weight" if kind == "list" else "dec.0.weight"].double()
    weight = model[1][0][0].weight if kind == "list" else model["dec"][0].weight
    expected += 0.5 * weight.detach().double()
    got = ema.module.state_dict()["1.2.0.weight" if kind == "list" else "enc.0.weight"]
    torch.testing.assert_close(got.double(), expected)


def test_meta_model_then_to_empty_and_resync():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    ema = fused_ema.ModelEma(model, decay=0.5)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        for b in model.buffers():
            b.zero_() if not b.is_floating_point() else b.fill_(0.5)
    with pytest.raises(fused_ema.StructureMismatchError, match="meta"):
        ema.update(model)
    # A load would drop the values into meta tensors: refused, the step untouched.
    with pytest.raises(fused_ema.CheckpointError, match="0.weight: this EMA's tensor is on meta"):
        ema.load_state_dict(model.state_dict(), step=5)
    assert ema.step == 0
    ema.resync(model)
    ema.update(model)
    weights = ema.state_dict()["weights"]
    for name, value in model.state_dict().items():
        assert weights[name].device.type == "cpu"
        assert torch.equal(weights[name].to(value.dtype), value), name


def test_resync_mode_follows_a_replaced_head():
    torch.manual_seed(2)
    model = trained(small_mlp(), 3)
    ema = fused_ema.ModelEma(model, decay=0.9, on_mismatch="resync")
    ema.update(model)
    kept = ema.module[0].weight.detach().clone()
    model[3] = nn.Linear(16, 2)  # a new head, as when fine-tuning for classification
    trained(model, 1, seed=3)
    ema.update(model)
    assert ema.module[3].weight.shape == (2, 16)
    assert torch.equal(ema.state_dict()["weights"]["3.weight"], model[3].weight)  # starts there
    assert not torch.equal(ema.module[0].weight, kept)  # the body keeps averaging
    torch.testing.assert_close(ema.module[0].weight, kept + 0.1 * (model[0].weight - kept))


def test_explicit_resync_then_update():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9)
    model.append(nn.Linear(4, 3))
    with pytest.raises(fused_ema.StructureMismatchError):
        ema.update(model)
    ema.resync(model)
    ema.update(model)
    assert "4.weight" in ema.names()
    assert ema.module[4].out_features == 3


def test_reshaped_in_place_is_detected():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, decay=0.9)
    ema.update(model)
    before = snapshot(ema)
    with torch.no_grad():
        model[3].weight.data = torch.randn(5, 16)  # same Parameter object, new shape
    with pytest.raises(
        fused_ema.StructureMismatchError, match=r"3.weight \(EMA \[4, 16\], model \[5, 16\]\)"
    ):
        ema.update(model)
    assert_unchanged(ema, before)


def test_a_tensor_whose_values_change_kind_is_a_change_not_a_lossy_cast():
    # A complex p.data was averaged by its real part (the constructor refuses complex parameters),
    # an integer buffer replaced by a float one truncated into the int EMA, a float buffer
    # replaced by an integer one was averaged: each is now reported, and resync starts it anew.
    torch.manual_seed(7)
    model = Net()
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model, step=1)
    before = snapshot(ema)
    weight = model.head.weight.data
    model.head.weight.data = torch.randn(4, 16, dtype=torch.complex64)
    pattern = r"head.weight \(EMA torch.float32 \[4, 16\], model torch.complex64 \[4, 16\]\)"
    with pytest.raises(fused_ema.StructureMismatchError, match=pattern):
        ema.update(model, step=2)
    assert_unchanged(ema, before)
    with pytest.raises(ValueError, match="parameter head.weight is torch.complex64"):
        ema.resync(model)
    assert_unchanged(ema, before)
    assert ema.step == 1
    model.head.weight.data = weight
    counted = torch.rand(()) * 100
    model.norm.num_batches_tracked = counted
    model.norm.running_mean = torch.randint(-9, 9, (16,))
    with pytest.raises(fused_ema.StructureMismatchError) as err:
        ema.update(model, step=2)
    assert err.value.reshaped == [
        "norm.running_mean (EMA torch.float32 [16], model torch.int64 [16])",
        "norm.num_batches_tracked (EMA torch.int64 [], model torch.float32 [])",
    ]
    assert_unchanged(ema, before)
    ema.resync(model)
    ema.update(model, step=2)
    after = ema.state_dict()["weights"]
    assert torch.equal(after["norm.running_mean"], model.norm.running_mean)  # copied, not averaged
    assert torch.equal(after["norm.num_batches_tracked"], counted)  # averaged from the model
    assert torch.equal(after["stem.weight"], 0.5 * (before["stem.weight"] + model.stem.weight))


def test_a_swapping_conversion_is_refused_and_the_documented_carry_over_keeps_the_average():
    """docs/devices-dtypes.md's known limit: swap_tensors refuses the EMA's model; state_dict,
    del, convert, a new EMA and load_state_dict carry the average over, converted."""
    torch.manual_seed(0)
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    trained(model, 1, seed=1)
    ema.update(model)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="swap"):
            model.to(torch.float64)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        sd = ema.state_dict()
        del ema
        model.to(torch.float64)
        ema = fused_ema.ModelEma(model, decay=0.5)
        ema.load_state_dict(sd)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    assert ema.step == 2
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(value, before[name].to(value.dtype)), name
    source = dict(model.named_parameters())["0.weight"].detach().clone()
    ema.update(model)
    expected = before["0.weight"].double().lerp(source, 0.5)
    torch.testing.assert_close(ema.state_dict()["weights"]["0.weight"], expected)


def test_swapped_puts_ema_in_place_and_restores_after_an_exception():
    torch.manual_seed(4)
    model = trained(small_mlp(), 3)
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    trained(model, 2, seed=5)
    ema.update(model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    expected = snapshot(ema)
    objects = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    with pytest.raises(KeyError):
        with ema.swapped(model) as inside:
            assert inside is model
            for name, param in model.named_parameters():
                assert param is objects[name][0] and param.data_ptr() == objects[name][1]
                assert torch.equal(param, expected[name])
            with pytest.raises(RuntimeError, match="swapped"):
                ema.update(model)
            raise KeyError("evaluation failed")
    for name, value in model.state_dict().items():
        assert torch.equal(value, original[name]), name
    assert_unchanged(ema, expected)


def test_swapped_with_a_bf16_model_and_fp32_ema():
    torch.manual_seed(6)
    model = trained(small_mlp(torch.bfloat16), 3)
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    trained(model, 2, seed=7)
    ema.update(model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    expected = snapshot(ema)
    with ema.swapped(model):
        assert torch.equal(model[0].weight, expected["0.weight"].to(torch.bfloat16))
    for name, value in model.state_dict().items():
        assert torch.equal(value, original[name]), name
    assert_unchanged(ema, expected)


def test_copy_to_writes_by_name():
    torch.manual_seed(8)
    model = trained(small_mlp(), 3)
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    trained(model, 2, seed=9)
    ema.update(model)
    target = small_mlp()
    ema.copy_to(target)
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(target.state_dict()[name], value), name
    other = nn.Sequential(nn.Linear(6, 16))
    with pytest.raises(fused_ema.StructureMismatchError):
        ema.copy_to(other)


class TiedHead(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.out = nn.Linear(6, 10, bias=False)
        if tie:
            self.out.weight = self.emb.weight


@pytest.mark.parametrize("call", ["copy_to", "set", "swapped"])
def test_a_model_without_the_emas_tie_is_refused_by_name(call):
    # One EMA tensor for emb.weight and out.weight: a model holding two tensors under those names
    # got only the first written (copy_to, swapped) or read (set), the other silently skipped.
    torch.manual_seed(21)
    model = TiedHead(tie=True)
    ema = fused_ema.ModelEma(model, decay=0.5)
    with torch.no_grad():
        model.emb.weight.add_(torch.randn_like(model.emb.weight))
    ema.update(model)
    before, step = snapshot(ema), ema.step
    other = TiedHead(tie=False)
    original = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(fused_ema.StructureMismatchError, match="out.weight"):
        if call == "swapped":
            with ema.swapped(other):
                pass
        else:
            getattr(ema, call)(other)
    for name, value in other.state_dict().items():
        assert torch.equal(value, original[name]), name
    assert_unchanged(ema, before)
    assert ema.step == step
    tied = TiedHead(tie=True)  # the same tie: written by name under both
    ema.copy_to(tied)
    assert torch.equal(tied.out.weight, before["out.weight"])


def test_a_resync_under_inference_mode_leaves_tensors_later_updates_can_write():
    # The new head's EMA tensors (and ema.module's copies) were made as inference tensors: every
    # update after the block raised, and a train-mode ema.module could not run.
    torch.manual_seed(23)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    ema = fused_ema.ModelEma(model, decay=0.5, on_mismatch="resync", buffers="ignore")
    ema.update(model)
    model[2] = nn.Linear(8, 3)
    with torch.inference_mode():
        ema.update(model)  # follows the new head: it starts from the model
    start = snapshot(ema)
    assert torch.equal(start["2.weight"], model[2].weight.detach())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update(model)
    for name, value in model.state_dict().items():
        if name in start:
            expected = start[name] + 0.5 * (value - start[name])
            assert torch.allclose(ema.state_dict()["weights"][name], expected), name
    ema.train()
    ema.module(torch.randn(4, 6))  # BatchNorm writes the statistics the EMA leaves out


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_the_errors_survive_pickling_and_copies(how):
    # Exception pickling rebuilt them from their message, read as the list of names (or problems):
    # an error sent from a spawned rank or worker listed every character of the text.
    def again(err):
        return pickle.loads(pickle.dumps(err)) if how == "pickle" else copy.deepcopy(err)

    model = small_mlp()
    ema = fused_ema.ModelEma(model, 0.9)
    model[0] = nn.Linear(model[0].in_features, 7)
    with pytest.raises(fused_ema.StructureMismatchError) as raised:
        ema.update(model)
    err, back = raised.value, again(raised.value)
    assert type(back) is fused_ema.StructureMismatchError and str(back) == str(err)
    assert (back.added, back.removed, back.reshaped, back.replaced, back.renamed) == (
        err.added,
        err.removed,
        err.reshaped,
        err.replaced,
        err.renamed,
    )
    assert back.reshaped and bool(back)
    state = fused_ema.ModelEma(small_mlp(), 0.9).state_dict()
    state["weights"] = {k + "_x": v for k, v in state["weights"].items()}
    with pytest.raises(fused_ema.CheckpointError) as raised:
        fused_ema.ModelEma(small_mlp(), 0.9).load_state_dict(state)
    err, back = raised.value, again(raised.value)
    assert type(back) is fused_ema.CheckpointError and str(back) == str(err)
    assert back.problems == err.problems and len(back.problems) >= 2


@pytest.mark.parametrize("call", ["update", "resync"])
def test_a_model_tensor_moved_to_meta_is_refused_by_name_with_nothing_changed(call):
    torch.manual_seed(7)
    model = trained(small_mlp(), 2)
    ema = fused_ema.ModelEma(model, decay=0.9, on_mismatch="resync")
    for _ in range(2):
        trained(model, 1, seed=8)
        ema.update(model)
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    model[3].to("meta")  # a model tensor with no values for the EMA's to follow
    with pytest.raises(RuntimeError, match=r"meta device and hold no values \(e\.g\. 3\.weight\)"):
        getattr(ema, call)(model)
    assert ema.step == 2
    after = ema.state_dict()["weights"]
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].device.type == "cpu" and torch.equal(after[k], v), k


@pytest.mark.parametrize("non_blocking", [False, True])
def test_an_update_before_the_meta_model_is_materialised_says_so(non_blocking):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    ema = fused_ema.ModelEma(model, decay=0.5)
    for _ in range(2):  # was "ema[0] and ema[1] share memory" (meta tensors have no address)
        with pytest.raises(RuntimeError, match=r"made from a meta-device model .*ema\.resync"):
            ema.update(model, non_blocking=non_blocking)
        assert ema.step == 0
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else 3)
    ema.resync(model)
    ema.update(model)
    assert ema.step == 1
    for name, value in model.state_dict().items():
        assert torch.equal(ema.state_dict()["weights"][name].to(value.dtype), value), name
