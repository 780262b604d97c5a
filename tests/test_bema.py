"""fused_ema.Bema, the bias-corrected EMA: its EMA, theta0 and corrected weights against an
independent float64 implementation of the paper's formulas (with TRL's meaning of t) over real
training runs, one fused pass per update, exact resume, checkpoints all or nothing, the evaluation
views, structure changes, compile, and bad arguments refused by name."""

import copy

import pytest
import torch
from bema_reference import PaperBema
from torch import nn
from track_helpers import fused_passes, net, train

import fused_ema
from conftest import DEVICES
from fused_ema import Bema
from fused_ema.errors import CheckpointError


def max_rel_error(ema: fused_ema.ModelEma, ref: dict) -> float:
    weights = ema.state_dict()["weights"]
    worst = 0.0
    for name, value in ref.items():
        got = weights[name].double().cpu()
        if not value.is_floating_point():
            assert torch.equal(weights[name].cpu(), value), name
            continue
        scale = value.abs().max().clamp_min(1e-12)
        worst = max(worst, float((got - value).abs().max() / scale))
    return worst


CONFIGS = [
    {},
    {"update_freq": 1},
    {"update_freq": 3, "update_after": 5},
    {"update_freq": 2, "update_after": 4, "lag": 0, "multiplier": 0.5, "min_ema_multiplier": 0.2},
    {"update_freq": 1, "ema_power": 0.0, "bias_power": 0.0},  # no EMA, full correction
    {"update_freq": 2, "bias_power": 8.0, "lag": 3, "multiplier": 2.0},
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_follows_the_papers_formulas_over_a_training_run(device, config):
    model = net(device=device)
    config = {"update_freq": 4, **config}
    bema = Bema(model, **config)
    ref = PaperBema(model, **config)

    def step(t):
        bema.update(model)
        ref.update(model, t)

    train(model, 40, step, device=device)
    assert bema.step == 40
    assert max_rel_error(bema.ema, ref.ema) < 1e-5
    assert max_rel_error(bema.theta0, ref.theta0) < 1e-5
    assert max_rel_error(bema.corrected, ref.out) < 1e-5
    module = bema.module.state_dict()
    for name, value in ref.out.items():
        got = module[name].cpu()
        assert torch.allclose(got.to(value.dtype), value, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_bfloat16_model_feeds_a_float32_bema(device):
    model = net(torch.bfloat16, device)
    bema = Bema(model, update_freq=2, update_after=3)
    ref = PaperBema(model, update_freq=2, update_after=3)
    assert bema.corrected.state_dict()["weights"]["0.weight"].dtype == torch.float32
    train(model, 20, lambda t: (bema.update(model), ref.update(model, t)), device=device)
    assert max_rel_error(bema.corrected, ref.out) < 1e-5


def test_the_trainers_step_decides_as_in_trl():
    """update(model, step=global_step): steps given out of a plain count (a resumed trainer)."""
    model = net()
    bema = Bema(model, update_freq=5, update_after=2)
    ref = PaperBema(model, update_freq=5, update_after=2)
    train(model, 20, lambda t: (bema.update(model, step=t + 100), ref.update(model, t + 100)))
    assert bema.step == 120
    assert max_rel_error(bema.corrected, ref.out) < 1e-5
    assert bema.factors(120) == pytest.approx(((10 + 120) ** -0.5, (10 + 120) ** -0.2))


def test_one_fused_pass_per_update():
    """The three tracks update through one bema_ pass per device, not one lerp_ per track."""
    model = net()
    bema = Bema(model, update_freq=1)
    passes = fused_passes(lambda: train(model, 3, lambda t: bema.update(model)))
    assert passes == ["bema_"] * 3


def test_swapped_module_and_copy_to_give_the_corrected_weights():
    model = net()
    bema = Bema(model, update_freq=2)
    train(model, 6, lambda t: bema.update(model))
    corrected = {k: v.clone() for k, v in bema.corrected.state_dict()["weights"].items()}
    training = copy.deepcopy(model.state_dict())
    x = torch.randn(5, 12)
    model.eval()
    with bema.swapped(model):
        for name, value in model.state_dict().items():
            assert torch.equal(value, corrected[name].to(value.dtype)), name
        inside = model(x)
    for name, value in model.state_dict().items():
        assert torch.equal(value, training[name]), name
    bema.eval()
    assert torch.equal(bema(x), inside)
    assert bema.running_model is bema.module
    other = net()
    bema.copy_to(other)
    assert torch.equal(other[0].weight, corrected["0.weight"])


def test_an_update_inside_swapped_is_refused_and_changes_nothing():
    """The corrected weights, swapped into the model, are a track the update writes: as
    ModelEma.update inside its own swapped(), refused before anything is written."""
    model = net()
    bema = Bema(model, update_freq=1)
    train(model, 4, lambda t: bema.update(model))
    saved = copy.deepcopy(bema.state_dict())
    training = copy.deepcopy(model.state_dict())
    with bema.swapped(model):
        inside = copy.deepcopy(model.state_dict())
        with pytest.raises(RuntimeError, match=r"update\(\) inside `with ema.swapped"):
            bema.update(model)
        for name, value in model.state_dict().items():
            assert torch.equal(value, inside[name]), name
    for name, value in model.state_dict().items():
        assert torch.equal(value, training[name]), name
    for track, weights in zip(bema._tracks, saved["emas"]):
        for name, value in weights["weights"].items():
            assert torch.equal(track.state_dict()["weights"][name], value), name
    assert [t.step for t in bema._tracks] == [4, 4, 4]


@pytest.mark.parametrize("make", [copy.copy, copy.deepcopy])
def test_a_copy_is_independent_and_leaves_the_original_whole(make):
    """copy.copy as copy.deepcopy (as ModelEma's): a shallow copy shared the tracks, and making
    them follow the leader again gave the original's update five weights instead of three."""
    model = net()
    bema, twin = Bema(model, update_freq=1), Bema(model, update_freq=1)
    train(model, 3, lambda t: bema.update(model))
    twin.load_state_dict(bema.state_dict())
    other = make(bema)
    train(model, 2, lambda t: (bema.update(model), twin.update(model)), seed=3, first=4)
    assert [t.step for t in other._tracks] == [3, 3, 3]
    other.update(model)
    for a, b in zip(bema._tracks, twin._tracks):
        for name, value in a.state_dict()["weights"].items():
            assert torch.equal(value, b.state_dict()["weights"][name]), name


def test_a_resumed_run_continues_bit_for_bit(tmp_path):
    model = net()
    whole = Bema(model, update_freq=3, update_after=2)
    snapshot = {}

    def step(t):
        whole.update(model)
        if t == 7:
            snapshot["model"] = copy.deepcopy(model)
            torch.save(whole.state_dict(), tmp_path / "bema.pt")

    train(model, 7, step)
    resumed_model = snapshot["model"]
    resumed = Bema(resumed_model, update_freq=3, update_after=2)
    resumed.load_state_dict(tmp_path / "bema.pt")
    assert resumed.step == 7
    train(model, 8, lambda t: whole.update(model), seed=5, first=8)
    train(resumed_model, 8, lambda t: resumed.update(resumed_model), seed=5, first=8)
    for a, b in zip(whole._tracks, resumed._tracks):
        assert a.step == b.step == 15
        for name, value in a.state_dict()["weights"].items():
            assert torch.equal(value, b.state_dict()["weights"][name]), name


def test_a_damaged_or_foreign_checkpoint_is_refused_whole_and_changes_nothing():
    model = net()
    bema = Bema(model, update_freq=2)
    train(model, 4, lambda t: bema.update(model))
    good = bema.state_dict()
    other = Bema(model, update_freq=2)
    train(model, 3, lambda t: other.update(model))
    before = [copy.deepcopy(t.state_dict()) for t in other._tracks]
    bad = copy.deepcopy(good)
    bad["emas"][2]["weights"]["0.weight"] = torch.zeros(3, 3)  # the corrected weights are wrong
    with pytest.raises(CheckpointError, match="corrected"):
        other.load_state_dict(bad)
    other_options = copy.deepcopy(good)
    other_options["options"]["update_freq"] = 400
    with pytest.raises(CheckpointError, match="update_freq 400 in the checkpoint"):
        other.load_state_dict(other_options)
    with pytest.raises(CheckpointError, match="not a Bema state dict"):
        other.load_state_dict(good["emas"][0])
    truncated = copy.deepcopy(good)
    truncated["emas"] = truncated["emas"][:2]
    with pytest.raises(CheckpointError, match="3 EMA state dicts"):
        other.load_state_dict(truncated)
    for step in (torch.tensor([4, 4]), 5):  # an array once raised "ambiguous" RuntimeError
        with pytest.raises(CheckpointError, match="beside EMAs at step 4"):
            other.load_state_dict({**good, "step": step})
    for b, track in zip(before, other._tracks):
        assert track.step == 3
        for name, value in b["weights"].items():
            assert torch.equal(value, track.state_dict()["weights"][name]), name


def test_inside_a_parent_modules_state_dict_it_round_trips():
    """...and a parent's load checks the options the tracks were saved with: they reached the
    checks only in a load of the Bema itself, so a parent's load took another run's EMAs."""

    class Holder(nn.Module):
        def __init__(self, model, update_freq=2):
            super().__init__()
            self.model = model
            self.bema = Bema(model, update_freq=update_freq)

    model = net()
    holder = Holder(model)
    train(model, 5, lambda t: holder.bema.update(model))
    state = holder.state_dict()
    assert "bema.corrected.weights.0.weight" in state and "bema.theta0.step" in state
    other = Holder(net())
    other.load_state_dict(state)
    for a, b in zip(holder.bema._tracks, other.bema._tracks):
        assert a.step == b.step == 5
        assert torch.equal(a.state_dict()["weights"]["3.bias"], b.state_dict()["weights"]["3.bias"])
    other = Holder(net(), update_freq=5)
    with pytest.raises(
        RuntimeError, match="bema: update_freq 2 in the checkpoint: this Bema has 5"
    ):
        other.load_state_dict(state)
    assert all(t.step == 0 for t in other.bema._tracks)
    del state["bema.theta0.weights.0.weight"]
    fresh = Holder(net())
    with pytest.raises(RuntimeError, match="bema.theta0.weights.0.weight"):
        fresh.load_state_dict(state)
    assert all(t.step == 0 for t in fresh.bema._tracks)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"update_freq": 0}, "update_freq"),
        ({"update_freq": 2.5}, "update_freq"),
        ({"update_after": -1}, "update_after"),
        ({"ema_power": -0.5}, "ema_power"),
        ({"ema_power": float("nan")}, "ema_power"),
        ({"bias_power": float("inf")}, "bias_power"),
        ({"bias_power": "0.2"}, "bias_power"),
        ({"lag": -1}, "lag"),
        ({"multiplier": -1.0}, "multiplier"),
        ({"lag": 0, "multiplier": 0}, "lag \\+ multiplier"),
        ({"min_ema_multiplier": 1.5}, "min_ema_multiplier"),
        ({"min_ema_multiplier": True}, "min_ema_multiplier"),
        ({"buffers": "some"}, "buffers"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Bema(net(), **kwargs)


def test_a_track_cannot_update_alone():
    model = net()
    bema = Bema(model, update_freq=1)
    bema.update(model)
    with pytest.raises(RuntimeError, match="update together"):
        bema.corrected.update(model)
    assert [t.step for t in bema._tracks] == [1, 1, 1]


@pytest.mark.parametrize(
    "change",
    [
        lambda e, model, opt: e.update(model),
        lambda e, model, opt: e.attach(opt),
        lambda e, model, opt: setattr(e, "decay", 0.5),
        lambda e, model, opt: setattr(e, "min_decay", 0.1),
        lambda e, model, opt: setattr(e, "update_every", 3),
        lambda e, model, opt: setattr(e, "update_after_step", 2),
        lambda e, model, opt: setattr(e, "step", 7),
    ],
    ids=["update", "attach", "decay", "min_decay", "update_every", "update_after_step", "step"],
)
@pytest.mark.parametrize("part", ["ema", "theta0", "corrected"])
def test_no_track_updates_attaches_or_changes_its_schedule_alone(change, part):
    """Each refused up front, naming Bema: an attached track's hook raised after every
    optimizer step (the model already stepped), a setter put the tracks out of step."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bema = Bema(model, update_freq=1)
    bema.update(model)
    before = [{k: v.clone() for k, v in t.state_dict()["weights"].items()} for t in bema._tracks]
    schedules = [t.schedule for t in bema._tracks]
    with pytest.raises(RuntimeError, match="one of a Bema's tracks"):
        change(getattr(bema, part), model, opt)
    train(model, 2, lambda t: None)  # an attached hook would update (or raise) here
    assert [t.step for t in bema._tracks] == [1, 1, 1]
    assert [t.schedule for t in bema._tracks] == schedules
    for b, track in zip(before, bema._tracks):
        assert all(torch.equal(v, track.state_dict()["weights"][k]) for k, v in b.items())
    bema.update(model)
    Bema(net(), update_freq=1).load_state_dict(bema.state_dict())


def test_every_track_follows_a_structure_change_or_refuses_it_whole():
    model = net()
    strict = Bema(model, update_freq=1)
    following = Bema(model, update_freq=1, on_mismatch="resync")
    train(model, 2, lambda t: (strict.update(model), following.update(model)))
    model.append(nn.Linear(3, 2))
    with pytest.raises(fused_ema.StructureMismatchError):
        strict.update(model)
    assert [t.step for t in strict._tracks] == [2, 2, 2]
    following.update(model)
    for track in following._tracks:
        assert track.step == 3
    # a new tensor starts as the model: its EMA and theta0 are the model, so is its correction
    assert torch.equal(following.corrected.state_dict()["weights"]["4.weight"], model[4].weight)


def test_non_blocking_updates_equal_blocking_ones():
    model = net()
    blocking = Bema(model, update_freq=2)
    later = Bema(model, update_freq=2)
    train(model, 7, lambda t: (blocking.update(model), later.update(model, non_blocking=True)))
    later.synchronize()
    for a, b in zip(blocking._tracks, later._tracks):
        for name, value in a.state_dict()["weights"].items():
            assert torch.equal(value, b.state_dict()["weights"][name]), name


def test_a_compiled_training_step_updates_bema_as_eager_does():
    model = net()
    eager_model = copy.deepcopy(model)
    compiled_bema = Bema(model, update_freq=2)
    eager_bema = Bema(eager_model, update_freq=2)

    @torch.compile(backend="eager")
    def update(m):
        compiled_bema.update(m)

    def step(t):
        update(model)
        eager_model.load_state_dict(model.state_dict())
        eager_bema.update(eager_model)

    train(model, 5, step)
    for a, b in zip(compiled_bema._tracks, eager_bema._tracks):
        assert a.step == b.step == 5
        for name, value in b.state_dict()["weights"].items():
            assert torch.equal(value, a.state_dict()["weights"][name]), name


def test_16_bit_tracks_of_bema_and_posthoc_give_no_warning_about_a_decay_they_do_not_apply():
    """PrecisionWarning read decay=1.0, the placeholder of Bema's and PostHocEma's tracks, and
    told Bema to keep stochastic_rounding=True, which it does not take."""
    import warnings

    from fused_ema.posthoc import PostHocEma

    model = net()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused_ema.PrecisionWarning)
        bema = Bema(model, dtype=torch.bfloat16)
        bema.load_state_dict(bema.state_dict())
        PostHocEma(model, (0.05, 0.1), dtype=torch.bfloat16, stochastic_rounding=False)
    with pytest.warns(fused_ema.PrecisionWarning, match="decay 0.9999"):
        fused_ema.ModelEma(model, 0.9999, dtype=torch.bfloat16, stochastic_rounding=False)
