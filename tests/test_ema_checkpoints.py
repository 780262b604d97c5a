"""Checkpoints: round trips across dtypes, files and the peers' formats (written by the real
packages where they install here: ema-pytorch, torch_ema, torch's AveragedModel; the documented
layout for timm and diffusers). Every rejected checkpoint leaves the EMA bit-identical, and one
error lists every problem."""

import json
import warnings

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fused_ema
from ema_helpers import TiedNet, small_mlp, train_step


def trained_pair(steps=6, seed=0, **ema_kwargs):
    torch.manual_seed(seed)
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = fused_ema.ModelEma(model, **{"decay": 0.9, **ema_kwargs})
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        train_step(model, opt, g)
        ema.update(model)
    return model, ema


def frozen(ema):
    return {k: v.clone() for k, v in ema.state_dict()["weights"].items()}, ema.step, ema.schedule


def assert_untouched(ema, before):
    weights, step, schedule = before
    now = ema.state_dict()["weights"]
    for name, value in weights.items():
        assert torch.equal(now[name], value), f"{name} changed by a rejected load"
    assert ema.step == step and ema.schedule == schedule


def assert_weights_equal(ema, expected: dict):
    now = ema.state_dict()["weights"]
    for name, value in expected.items():
        assert torch.equal(now[name], value.to(now[name].dtype)), name


def test_round_trip_restores_weights_step_and_schedule(tmp_path):
    model, source = trained_pair(warmup=(2.0, 0.5), update_after_step=2, update_every=2)
    torch.save(source.state_dict(), tmp_path / "ema.pt")
    target = fused_ema.ModelEma(model, decay=0.5)  # a resumed run: same model, fresh EMA
    result = target.load_state_dict(tmp_path / "ema.pt")
    assert result == fused_ema.LoadResult("fused_ema", [], [], [])
    assert_weights_equal(target, source.state_dict()["weights"])
    assert target.step == source.step and target.schedule == source.schedule
    assert target.current_decay == source.current_decay
    source.update(model)
    target.update(model)
    assert_weights_equal(target, source.state_dict()["weights"])


@pytest.mark.parametrize(
    "saved, loaded",
    [
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_round_trip_across_dtypes(saved, loaded, recwarn):
    _, source = trained_pair(dtype=saved)
    target = fused_ema.ModelEma(small_mlp(), decay=0.9, dtype=loaded)
    target.load_state_dict(source.state_dict())
    for name, value in source.state_dict()["weights"].items():
        got = target.state_dict()["weights"][name]
        assert got.dtype == (loaded if value.is_floating_point() else value.dtype)
        assert torch.equal(got, value.to(got.dtype)), name


def test_tied_weights_load_from_either_name():
    torch.manual_seed(0)
    model = TiedNet()
    source = fused_ema.ModelEma(model, decay=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt)
    source.update(model)
    state = source.state_dict()
    assert "head.weight" in state["weights"] and "embed.weight" in state["weights"]
    del state["weights"]["head.weight"]
    target = fused_ema.ModelEma(TiedNet(), decay=0.5)
    target.load_state_dict(state)
    assert torch.equal(target.module.head.weight, source.module.embed.weight)


def test_tied_weights_that_differ_inside_a_parents_state_dict_are_named():
    """The parent's error names the tie, as ema.load_state_dict does (it once read
    'weights.None')."""
    parent = torch.nn.ModuleDict({"ema": fused_ema.ModelEma(TiedNet(), decay=0.5)})
    state = {k: v.clone() for k, v in parent.state_dict().items()}
    state["ema.weights.head.weight"] += 1
    before = frozen(parent["ema"])
    with pytest.raises(RuntimeError, match=r"ema\.weights\.head\.weight: tied to embed\.weight"):
        parent.load_state_dict(state)
    assert_untouched(parent["ema"], before)


def test_tied_weights_holding_nan_load_from_their_own_checkpoint(tmp_path):
    """NaN propagates into the average; a tied weight holding NaN is still one tensor, so the EMA
    loads its own file (torch.load gives each name its own tensor object)."""
    torch.manual_seed(0)
    model = TiedNet()
    source = fused_ema.ModelEma(model, decay=0.5)
    with torch.no_grad():
        model.embed.weight[torch.randint(11, (1,)), torch.randint(8, (1,))] = float("nan")
    source.update(model)
    torch.save(source.state_dict(), tmp_path / "ema.pt")
    target = fused_ema.ModelEma(TiedNet(), decay=0.5)
    target.load_state_dict(tmp_path / "ema.pt")
    want, got = source.state_dict()["weights"], target.state_dict()["weights"]
    for name in ("embed.weight", "head.weight"):
        assert torch.equal(got[name].isnan(), want[name].isnan())
        assert torch.equal(got[name].nan_to_num(), want[name].nan_to_num())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["head.weight"][~state["head.weight"].isnan()] += 1  # same NaN, other values: refused
    rejected(fused_ema.ModelEma(TiedNet(), decay=0.5), state, "head.weight: tied to embed.weight")


# ------------------------------------------------------------------------- rejections


def rejected(ema, state, *messages, strict=True):
    before = frozen(ema)
    with pytest.raises(fused_ema.CheckpointError) as info:
        ema.load_state_dict(state, strict=strict)
    for message in messages:
        assert message in str(info.value), str(info.value)
    assert_untouched(ema, before)
    return info.value


def test_missing_unexpected_reshaped_and_wrong_dtype_all_in_one_error():
    _, ema = trained_pair()
    state = ema.state_dict()
    weights = {k: v.clone() for k, v in state["weights"].items()}
    del weights["0.bias"]
    weights["extra.weight"] = torch.zeros(2)
    weights["3.weight"] = torch.zeros(5, 16)
    weights["1.num_batches_tracked"] = torch.tensor(1.5)
    weights["0.weight"] = torch.zeros(16, 6, dtype=torch.int32)
    state["weights"] = weights
    err = rejected(
        ema,
        state,
        "missing from the checkpoint: 0.bias",
        "not in this EMA: extra.weight",
        "3.weight: shape [5, 16]",
        "1.num_batches_tracked: dtype torch.float32",
        "0.weight: dtype torch.int32",
    )
    assert len(err.problems) == 5


def test_strict_false_loads_what_matches_and_reports_the_rest():
    _, source = trained_pair(seed=3)
    _, target = trained_pair(seed=4)
    state = source.state_dict()
    weights = {k: v for k, v in state["weights"].items() if k != "0.bias"}
    weights["3.weight"] = torch.zeros(5, 16)
    weights["stray"] = torch.zeros(1)
    state["weights"] = weights
    old_bias = target.state_dict()["weights"]["0.bias"].clone()
    old_head = target.state_dict()["weights"]["3.weight"].clone()
    result = target.load_state_dict(state, strict=False)
    assert result.missing_keys == ["0.bias"] and result.unexpected_keys == ["stray"]
    assert result.mismatched_keys == ["3.weight"]
    now = target.state_dict()["weights"]
    assert torch.equal(now["0.bias"], old_bias) and torch.equal(now["3.weight"], old_head)
    assert torch.equal(now["0.weight"], source.state_dict()["weights"]["0.weight"])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.update(step=torch.tensor(-3)), "step must be a whole number in"),
        (lambda s: s.update(step=2.5), "whole number"),
        (lambda s: s.update(schedule={"decay": 2.0}), "schedule: decay must be"),
        (lambda s: s.update(schedule={"decay": 0.9, "colour": 1}), "unknown schedule keys"),
        (lambda s: s.update(format_version=99), "format_version 99"),
        (lambda s: s.update(weights=[1, 2]), "'weights' is missing or not a dict"),
    ],
)
def test_bad_step_schedule_and_format(mutate, message):
    _, ema = trained_pair()
    state = ema.state_dict()
    mutate(state)
    rejected(ema, state, message)
    rejected(ema, state, message, strict=False)  # format problems stop a non-strict load too


def test_odd_keys_and_array_valued_headers_are_checkpoint_errors():
    """Keys that are no names and a format / format_version holding an array are reported as what
    they are (they once raised AttributeError and 'Boolean value of Tensor ... is ambiguous')."""
    _, ema = trained_pair()
    rejected(ema, {0: torch.zeros(3)}, "not in this EMA: 0")
    rejected(ema, {7: torch.zeros(1), "n_averaged": torch.tensor(1)}, "not in this EMA: 7")
    state = ema.state_dict()
    state["format_version"] = torch.ones(2, dtype=torch.int64)
    rejected(ema, state, "format_version tensor([1, 1])")
    state = ema.state_dict()
    state["format"] = torch.zeros(3)
    rejected(ema, state, "not an EMA checkpoint")
    state = ema.state_dict()
    state["weights"][5] = torch.zeros(1)
    rejected(ema, state, "not in this EMA: 5")
    assert ema.load_state_dict(state, strict=False).unexpected_keys == [5]


def test_a_bad_rounding_is_listed_with_the_other_problems():
    _, ema = trained_pair()
    state = ema.state_dict()
    state["rounding"] = {"stochastic_rounding": 1}
    state["weights"]["0.weight"] = torch.zeros(1)
    error = rejected(ema, state, "rounding: expected", "0.weight: shape [1]")
    assert len(error.problems) == 2


def test_foreign_and_broken_inputs(tmp_path):
    model, ema = trained_pair()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rejected(ema, optimizer.state_dict(), "not an EMA checkpoint")
    rejected(ema, [1, 2, 3], "expected a dict")
    good = tmp_path / "good.pt"
    torch.save(ema.state_dict(), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    rejected(ema, truncated, "could not read it", "truncated.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all" * 10)
    rejected(ema, garbage, "could not read it")
    rejected(ema, tmp_path / "absent.pt", "could not read it")


def test_a_safetensors_file_loads_as_a_state_dict(tmp_path):
    """As `python -m fused_ema.posthoc` writes one: the files of a save_pretrained folder and a
    lone file go through one reader."""
    from safetensors.torch import save_file

    _, ema = trained_pair()
    save_file(ema.state_dict()["weights"], str(tmp_path / "ema.safetensors"))
    _, again = trained_pair(seed=1)
    assert again.load_state_dict(tmp_path / "ema.safetensors").format == "state dict"
    for name, value in ema.state_dict()["weights"].items():
        assert torch.equal(again.state_dict()["weights"][name], value), name


def test_meta_tensors_are_refused():
    _, ema = trained_pair()
    state = ema.state_dict()
    state["weights"] = {k: torch.empty_like(v, device="meta") for k, v in state["weights"].items()}
    rejected(ema, state, "a meta tensor holds no values")


# ------------------------------------------------------------------------- peer formats


def test_timm_training_checkpoint(tmp_path):
    model, ema = trained_pair(seed=5)
    expected = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    checkpoint = {  # timm's CheckpointSaver layout
        "epoch": 3,
        "arch": "mlp",
        "version": 2,
        "state_dict": model.state_dict(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
        "state_dict_ema": expected,
        "metric": 0.5,
    }
    torch.save(checkpoint, tmp_path / "last.pth.tar")
    target = fused_ema.ModelEma(small_mlp())
    assert target.load_state_dict(tmp_path / "last.pth.tar").format == "timm checkpoint"
    assert_weights_equal(target, expected)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_prefixed_model_state_dicts(prefix):
    _, ema = trained_pair(seed=6)
    expected = ema.state_dict()["weights"]
    target = fused_ema.ModelEma(small_mlp())
    result = target.load_state_dict({prefix + k: v for k, v in expected.items()})
    assert result.format == "state dict"
    assert_weights_equal(target, expected)


class _ChildCalledModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = small_mlp()


def _child_called_module(seed: int):
    """The class of a model whose one child is called `module`, and the weights of an EMA of
    one (moved off its initial values) after one update."""
    torch.manual_seed(seed)
    model = _ChildCalledModule()
    ema = fused_ema.ModelEma(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update(model, step=1)
    return _ChildCalledModule, {k: v.clone() for k, v in ema.module.state_dict().items()}


def test_a_model_whose_child_is_called_module_loads_its_own_state_dict():
    """`module.` is stripped only where the names as written match fewer of the EMA's names."""

    Wrapper, expected = _child_called_module(seed=7)
    assert all(k.startswith("module.") for k in expected)
    for checkpoint in (expected, {"state_dict_ema": expected}):
        target = fused_ema.ModelEma(Wrapper())
        assert target.load_state_dict(checkpoint).missing_keys == []
        assert_weights_equal(target, expected)


class _WithExtraState(nn.Linear):
    def get_extra_state(self):
        return {"calls": 3}

    def set_extra_state(self, state):
        pass


def test_extra_state_is_skipped_and_a_non_tensor_entry_is_named():
    torch.manual_seed(8)
    model = nn.Sequential(_WithExtraState(4, 3), nn.ReLU(), nn.Linear(3, 2))
    state = {
        k: v.detach() + torch.randn_like(v)
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor)
    } | {"0._extra_state": {"calls": 3}}
    expected = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    for checkpoint in (state, {"state_dict_ema": state}):
        ema = fused_ema.ModelEma(model)
        assert ema.load_state_dict(checkpoint).format in ("state dict", "timm checkpoint")
        assert_weights_equal(ema, expected)
    ema = fused_ema.ModelEma(model)
    rejected(ema, state | {"0.bias": None}, "0.bias: expected a tensor, got NoneType")
    with pytest.raises(fused_ema.CheckpointError) as err:
        ema.load_state_dict(state | {"0.bias": None})
    assert "missing" not in str(err.value) and "not an EMA checkpoint" not in str(err.value)


@pytest.mark.parametrize("kind", ["PostHocEma", "Bema"])
def test_strict_false_reports_every_tracks_unmatched_keys(kind):
    torch.manual_seed(9)
    model = small_mlp()
    make = {
        "PostHocEma": lambda: fused_ema.PostHocEma(
            model, sigma_rels=(0.05, 0.1), snapshot_dir=None
        ),
        "Bema": lambda: fused_ema.Bema(model, update_freq=2),
    }[kind]
    source = make()
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        source.update(model, step=step)
    state = source.state_dict()
    name = next(iter(state["emas"][1]["weights"]))
    state["emas"][1]["weights"][name] = torch.randn(2, 2)
    target = make()
    before = target._tracks[1].state_dict()["weights"][name].clone()
    result = target.load_state_dict(state, strict=False)
    assert result.mismatched_keys == [f"{target._track_names[1]}.{name}"]
    assert torch.equal(target._tracks[1].state_dict()["weights"][name], before)
    for k in (0, 2) if kind == "Bema" else (0,):
        assert_weights_equal(target._tracks[k], state["emas"][k]["weights"])


def test_averaged_model_file(tmp_path):
    torch.manual_seed(7)
    model = small_mlp()
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        train_step(model, opt)
        averaged.update_parameters(model)
    torch.save(averaged.state_dict(), tmp_path / "swa.pt")
    target = fused_ema.ModelEma(small_mlp(), decay=0.9)
    assert target.load_state_dict(tmp_path / "swa.pt").format == "AveragedModel"
    assert target.step == 4
    assert_weights_equal(
        target, {k[7:]: v for k, v in averaged.state_dict().items() if k.startswith("module.")}
    )


def test_ema_pytorch_file(tmp_path):
    ema_pytorch = pytest.importorskip("ema_pytorch")
    torch.manual_seed(8)
    model = small_mlp()
    theirs = ema_pytorch.EMA(model, beta=0.9, update_after_step=0, update_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        train_step(model, opt)
        theirs.update()
    torch.save(theirs.state_dict(), tmp_path / "ema_pytorch.pt")
    target = fused_ema.ModelEma(small_mlp(), decay=0.9)
    assert target.load_state_dict(tmp_path / "ema_pytorch.pt").format == "ema-pytorch"
    assert target.step == int(theirs.step)
    assert_weights_equal(
        target, {k: v for k, v in theirs.ema_model.state_dict().items() if v.is_floating_point()}
    )


def test_torch_ema_file(tmp_path):
    torch_ema = pytest.importorskip("torch_ema")
    torch.manual_seed(9)
    model = small_mlp()
    theirs = torch_ema.ExponentialMovingAverage(model.parameters(), decay=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        train_step(model, opt)
        theirs.update()
    torch.save(theirs.state_dict(), tmp_path / "torch_ema.pt")
    target = fused_ema.ModelEma(small_mlp(), decay=0.9)
    assert target.load_state_dict(tmp_path / "torch_ema.pt", strict=False).format == "torch_ema"
    assert target.step == 5
    params = [n for n, _ in small_mlp().named_parameters()]
    assert_weights_equal(target, dict(zip(params, theirs.shadow_params)))
    # the file holds parameters only: a strict load names the buffers it lacks
    rejected(target, tmp_path / "torch_ema.pt", "missing from the checkpoint: 1.running_mean")


def test_diffusers_ema_model_layout():
    torch.manual_seed(10)
    model = small_mlp()
    shadow = [p.detach().clone() + 1 for p in model.parameters()]
    state = {
        "decay": 0.9999,
        "min_decay": 0.0,
        "optimization_step": 42,
        "update_after_step": 0,
        "use_ema_warmup": False,
        "inv_gamma": 1.0,
        "power": 2 / 3,
        "shadow_params": shadow,
    }
    target = fused_ema.ModelEma(model, buffers="ignore")
    assert target.load_state_dict(state).format == "diffusers EMAModel"
    assert target.step == 42
    names = [n for n, _ in model.named_parameters()]
    assert_weights_equal(target, dict(zip(names, shadow)))
    state["shadow_params"] = shadow[:-1]
    rejected(target, state, "it holds 5 parameters in order but the model has 6")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tensor_whose_memory_was_freed_is_refused(dtype):
    """A checkpoint tensor whose storage was freed (resize_(0), as FSDP and ZeRO-3 do outside a
    gather) once crashed the process in the copy; now it is named before anything is written."""
    _, ema = trained_pair(seed=3)
    state = {
        k: v.to(dtype) if v.is_floating_point() else v.clone() for k, v in frozen(ema)[0].items()
    }
    state["0.weight"].untyped_storage().resize_(0)
    need = 6 * 16 * dtype.itemsize
    rejected(ema, state, f"0.weight: its storage holds 0 of the {need} bytes")


class _IntegerBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("count", torch.tensor(5, dtype=torch.int32))
        self.register_buffer("codes", torch.tensor([1, 2], dtype=torch.uint8))


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("count", torch.tensor(2**32 + 7), "count: values in [4294967303, 4294967303] do not fit"),
        (
            "codes",
            torch.tensor([-1, 7]),
            "codes: values in [-1, 7] do not fit the EMA's torch.uint8",
        ),
        ("codes", torch.tensor([3, 300]), "range [0, 255]"),
    ],
)
def test_integer_values_that_do_not_fit_the_emas_dtype_are_refused(name, value, message):
    torch.manual_seed(4)
    model = _IntegerBuffers()
    ema = fused_ema.ModelEma(model, decay=0.9)
    with torch.no_grad():
        model.lin.weight.add_(torch.randn(2, 2))
        model.count.fill_(9)
        model.codes.copy_(torch.tensor([200, 17]))
    ema.update(model, step=1)
    state = ema.state_dict()
    state["weights"] = {k: v.clone() for k, v in state["weights"].items()}
    state["weights"][name] = value
    rejected(ema, state, message)
    # Values that fit load, from another integer dtype or the EMA's own.
    state["weights"]["count"] = torch.tensor(-(2**31))
    state["weights"]["codes"] = torch.tensor([0, 255], dtype=torch.int16)
    ema.load_state_dict(state)
    assert ema.module.count.item() == -(2**31) and ema.module.codes.tolist() == [0, 255]


def test_a_fused_ema_checkpoint_without_its_step_is_refused_when_strict():
    """fused_ema always saves its step: without it a strict load would restart the EMA silently."""
    _, ema = trained_pair(seed=5)
    state = ema.state_dict()
    for damage in ("deleted", None):
        if damage is None:
            state["step"] = None
        else:
            del state["step"]
        rejected(ema, state, "'step' is missing")
    fresh = trained_pair(seed=8)[1]
    assert fresh.load_state_dict(state, step=4).missing_keys == [] and fresh.step == 4
    fresh.load_state_dict(state, strict=False)  # the documented fallback: loads as started
    assert fresh.step == fresh.schedule["update_after_step"] + 1


def test_a_child_called_module_under_one_wrapper_prefix():
    """Exactly the wrapper's prefix goes: torch.compile's `_orig_mod.` or DDP's `module.` in
    front of a model whose one child is called `module` (every repeated prefix once went)."""

    Wrapper, expected = _child_called_module(seed=9)
    for prefix in ("_orig_mod.", "module.", "module._orig_mod."):
        target = fused_ema.ModelEma(Wrapper())
        result = target.load_state_dict({prefix + k: v for k, v in expected.items()})
        assert result.missing_keys == [] and result.unexpected_keys == [], prefix
        assert_weights_equal(target, expected)


def test_a_parents_load_refuses_other_name_filters_as_a_flat_load_does():
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))

    class WithEma(nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.net = net
            self.ema = fused_ema.ModelEma(net, decay=0.9, **kwargs)

    torch.manual_seed(10)
    saved, loaded = WithEma(copy_names=["0.*"]), WithEma()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
    saved.ema.update(net, step=3)
    rejected(loaded.ema, saved.ema.state_dict(), "saved with copy_names=['0.*']")
    before = frozen(loaded.ema)
    with pytest.raises(RuntimeError, match=r"ema: saved with copy_names=\['0\.\*'\]"):
        loaded.load_state_dict(saved.state_dict())
    assert_untouched(loaded.ema, before)
    loaded.load_state_dict(WithEma(copy_names=[]).state_dict())  # the same filters load


def test_a_parents_load_with_keys_the_ema_does_not_know_says_the_ema_was_not_loaded():
    """torch does not tell a submodule whether its parent's load is strict: an extra key under
    the EMA's prefix, or a missing step, kept the EMA as it was without a word under
    strict=False (only that key was reported). It warns now, and only that (with warmup on, a
    missing step also warned of the step the EMA would load at)."""
    torch.manual_seed(11)
    net = small_mlp()
    source = nn.ModuleDict({"net": net, "ema": fused_ema.ModelEma(net, 0.9)})
    train_step(net, torch.optim.SGD(net.parameters(), lr=0.1))
    source["ema"].update(net, step=5)
    state = {**source.state_dict(), "ema.note": torch.tensor(1)}
    ema = fused_ema.ModelEma(small_mlp(), 0.5, warmup=True)
    target = nn.ModuleDict({"net": small_mlp(), "ema": ema})
    before = frozen(target["ema"])
    with pytest.warns(UserWarning, match=r"ema was not loaded: .*\(ema.note\).*strict=False"):
        assert target.load_state_dict(state, strict=False).unexpected_keys == ["ema.note"]
    assert_untouched(target["ema"], before)
    del state["ema.step"], state["ema.note"]
    with pytest.warns(UserWarning, match=r"ema was not loaded: .*\(ema.step\)") as caught:
        with pytest.raises(RuntimeError, match="Missing key.*ema.step"):
            target.load_state_dict(state)
    assert [str(w.message) for w in caught if "stores no step" in str(w.message)] == []
    assert_untouched(target["ema"], before)
    target["ema"].load_state_dict(source["ema"].state_dict())  # the remedy the warning gives
    assert target["ema"].step == 5


# ------------------------------------------------------------------------- fixes: complex buffers,
# numpy steps, loads that match nothing, nested own state dicts, float16 range, tie dtypes, folders


class _WithComplexBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("freqs", torch.randn(4, dtype=torch.complex64))


def test_a_complex_buffer_is_copied_and_loads_from_every_layout():
    """A complex buffer was refused by every load ('dtype torch.complex64 cannot be stored in the
    EMA's torch.complex64'): the EMA's own state dict, the model's and a parent's."""
    torch.manual_seed(12)
    model = _WithComplexBuffer()
    ema = fused_ema.ModelEma(model, decay=0.9)
    ema.update(model, step=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.lin.weight.add_(torch.randn(3, 3))
        model.freqs.copy_(torch.randn(4, dtype=torch.complex64))
    ema.update(model, step=2)
    assert torch.equal(ema.module.freqs, model.freqs)  # copied, not averaged
    want = start["lin.weight"] + 0.1 * (model.lin.weight.detach() - start["lin.weight"])
    torch.testing.assert_close(ema.module.lin.weight, want)
    checkpoint = {k: v + torch.randn_like(v) for k, v in model.state_dict().items()}
    target = fused_ema.ModelEma(_WithComplexBuffer(), decay=0.9)
    assert target.load_state_dict(checkpoint).missing_keys == []
    assert_weights_equal(target, checkpoint)
    again = fused_ema.ModelEma(_WithComplexBuffer(), decay=0.9)
    again.load_state_dict(target.state_dict())
    assert_weights_equal(again, checkpoint)
    parent = nn.ModuleDict({"ema": fused_ema.ModelEma(_WithComplexBuffer(), decay=0.9)})
    parent.load_state_dict(nn.ModuleDict({"ema": target}).state_dict())
    assert_weights_equal(parent["ema"], checkpoint)
    state = ema.state_dict()
    state["weights"]["freqs"] = torch.randn(4)
    rejected(ema, state, "freqs: dtype torch.float32 cannot be stored in the EMA's torch.complex64")
    state = ema.state_dict()
    state["weights"]["lin.bias"] = torch.randn(3, dtype=torch.complex64)
    rejected(ema, state, "lin.bias: dtype torch.complex64 cannot be stored")
    # complex128 parts past float32's range would turn infinite in the complex64 buffer
    for big in (complex(1e39, 0.5), complex(0.5, -1e300)):
        state = ema.state_dict()
        state["weights"]["freqs"] = torch.randn(4, dtype=torch.complex128)
        state["weights"]["freqs"][2] = big
        rejected(ema, state, "freqs: values up to", "torch.complex64", "infinite")
    state["weights"]["freqs"][2] = complex(3e38, -3e38)  # in range: loads
    ema.load_state_dict(state)
    assert torch.equal(ema.module.freqs, state["weights"]["freqs"].to(torch.complex64))


def test_numpy_steps_that_are_not_one_integer_are_refused_by_name():
    """np.array([5]) as a step raised a bare TypeError ('only integer scalar arrays ...') from
    every entry point; a 0-d numpy integer loads as its number."""
    np = pytest.importorskip("numpy")
    model, ema = trained_pair(seed=13)
    averaged = AveragedModel(model, use_buffers=True)
    averaged.update_parameters(model)
    for bad in (np.array([5]), np.array([[1, 2]])):
        state = ema.state_dict()
        state["step"] = bad
        rejected(ema, state, "step must be a whole number")
        swa = averaged.state_dict()
        swa["n_averaged"] = bad
        rejected(ema, swa, "n_averaged must be a whole number", strict=False)
        before = frozen(ema)
        for attempt in (
            lambda b=bad: ema.load_state_dict(ema.state_dict(), step=b),
            lambda b=bad: setattr(ema, "step", b),
            lambda b=bad: ema.update(model, step=b),
        ):
            with pytest.raises(ValueError, match="step must be a whole number"):
                attempt()
            assert_untouched(ema, before)
    for good in (np.int64(7), np.array(7)):
        state = ema.state_dict()
        state["step"] = good
        other_model, target = trained_pair(seed=14)
        target.load_state_dict(state)
        assert target.step == 7
        target.load_state_dict(ema.state_dict(), step=good)
        assert target.step == 7
        target.step = good
        assert target.step == 7
        twin = fused_ema.ModelEma(other_model, decay=0.9)
        twin.load_state_dict(target.state_dict())
        old = target.state_dict()["weights"]["0.weight"].clone()
        target.update(other_model, step=good)
        twin.update(other_model, step=7)
        assert target.step == 7
        want = old + 0.1 * (other_model[0].weight.detach() - old)
        torch.testing.assert_close(target.state_dict()["weights"]["0.weight"], want)
        assert_weights_equal(target, twin.state_dict()["weights"])


def test_strict_false_loading_no_tensor_keeps_step_and_schedule():
    """A non-strict load that matched no tensor took the other checkpoint's step and schedule
    (or, with no step in it, restarted at update_after_step + 1 with a warning), so the EMA held
    one run's weights at another's step."""
    torch.manual_seed(15)
    model, ema = trained_pair(seed=15, warmup=(2.0, 0.5), update_after_step=1)
    other = fused_ema.ModelEma(nn.Linear(5, 2), decay=0.5, warmup=True, update_after_step=7)
    other.step = 99
    every = sorted(ema.names())
    for foreign in (nn.Linear(5, 2).state_dict(), other.state_dict()):
        before = frozen(ema)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = ema.load_state_dict(foreign, strict=False)
        assert [str(w.message) for w in caught] == []
        assert sorted(result.missing_keys) == every
        assert_untouched(ema, before)
    weights, _, schedule = frozen(ema)
    ema.load_state_dict(nn.Linear(5, 2).state_dict(), strict=False, step=40)
    assert ema.step == 40
    assert_untouched(ema, (weights, 40, schedule))
    source = fused_ema.ModelEma(model, decay=0.7, update_after_step=3)
    source.step = 13
    with torch.no_grad():
        for p in source.module.parameters():
            p.add_(torch.randn_like(p))
    state = source.state_dict()
    del state["weights"]["0.bias"]
    assert ema.load_state_dict(state, strict=False).missing_keys == ["0.bias"]
    assert ema.step == 13 and ema.schedule == source.schedule
    assert_weights_equal(ema, state["weights"])


def test_a_training_checkpoint_holding_the_emas_state_dict_loads_it(tmp_path):
    """The README's layout loaded state_dict_ema (a timm checkpoint): the step fell to
    update_after_step + 1 and the schedule stayed the fresh EMA's. Two fused_ema state dicts in
    one checkpoint are ambiguous."""
    model, ema = trained_pair(seed=16, warmup=(2.0, 0.5), update_after_step=2, update_every=2)
    checkpoint = {
        "state_dict": model.state_dict(),
        "state_dict_ema": ema.module.state_dict(),
        "ema": ema.state_dict(),
    }
    torch.save(checkpoint, tmp_path / "train.pt")
    again = fused_ema.ModelEma(small_mlp(), decay=0.5)
    assert again.load_state_dict(tmp_path / "train.pt").format == "fused_ema"
    assert again.step == ema.step == 6 and again.schedule == ema.schedule
    assert_weights_equal(again, ema.state_dict()["weights"])
    _, slow = trained_pair(seed=17, decay=0.99)
    torch.save({**checkpoint, "ema_slow": slow.state_dict()}, tmp_path / "two.pt")
    rejected(trained_pair(seed=18)[1], tmp_path / "two.pt", "holds 2 fused_ema state dicts")


def test_float32_values_past_float16s_range_are_refused():
    """A float16 EMA silently loaded 70000.0 as inf. Values in range, and a checkpoint's own
    inf/NaN (finite values only are checked), load as torch's cast gives them."""
    torch.manual_seed(19)
    for ema in (
        fused_ema.ModelEma(small_mlp(), decay=0.9, dtype=torch.float16),
        fused_ema.ModelEma(small_mlp(), decay=0.9).to(torch.float16),
    ):
        weights = {
            k: torch.randn(v.shape) if v.is_floating_point() else v
            for k, v in ema.state_dict()["weights"].items()
        }
        for big in (70000.0, -1e6):
            bad = {**weights, "0.weight": weights["0.weight"].clone()}
            bad["0.weight"][1, 2] = big
            err = rejected(ema, bad, "0.weight: values up to", "torch.float16", "infinite")
            assert len(err.problems) == 1
        fine = {**weights, "0.weight": weights["0.weight"].clone()}
        fine["0.weight"][0, :4] = torch.tensor([65504.0, -65000.0, float("inf"), float("nan")])
        ema.load_state_dict(fine)
        got = ema.state_dict()["weights"]["0.weight"]
        want = fine["0.weight"].half()
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_a_tie_given_in_two_dtypes_says_so():
    """A tie given as float64 and float32 with the same values was said to 'hold different
    values'."""
    torch.manual_seed(20)
    ema = fused_ema.ModelEma(TiedNet(), decay=0.5)
    state = ema.state_dict()
    value = torch.randn_like(state["weights"]["embed.weight"])
    state["weights"]["embed.weight"] = value.double()
    state["weights"]["head.weight"] = value.clone()
    err = rejected(ema, state, "tied to embed.weight", "have different dtypes")
    assert "hold different values" not in str(err)


def test_a_bad_folder_index_and_buffers_entry_are_named(tmp_path):
    """A weight_map that is a list gave AttributeError text, and one naming '../x.safetensors'
    read a file outside the folder; a 'buffers' entry of 42 was ignored."""
    from safetensors.torch import save_file

    model, ema = trained_pair(seed=21)
    values = {
        k: v + torch.randn_like(v) if v.is_floating_point() else v
        for k, v in model.state_dict().items()
    }
    save_file(values, str(tmp_path / "x.safetensors"))
    folder = tmp_path / "model"
    folder.mkdir()
    save_file(values, str(folder / "diffusion_pytorch_model.safetensors"))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    for weight_map in (list(values), {k: "../x.safetensors" for k in values}):
        index.write_text(json.dumps({"weight_map": weight_map}))
        rejected(ema, folder, "'weight_map'")
    state = ema.state_dict()
    state["buffers"] = 42
    rejected(ema, state, "buffers must be one of", "got 42")
    rejected(ema, state, "buffers must be one of", strict=False)
