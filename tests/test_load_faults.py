"""A load that has begun writing finishes: an interrupt landing among its copies, or between the
weights and the step, leaves the whole checkpoint loaded (ModelEma, PostHocEma, Bema), never
the weights of one with the step of another. And the checks a load makes before writing: tied
names, a checkpoint made of the EMA's own tensors, the tracks of a PostHocEma or Bema."""

import copy
import warnings

import pytest
import torch
from torch import nn

import fused_ema
from ema_helpers import small_mlp, trained
from fused_ema import Bema, CheckpointError, ModelEma
from fused_ema._model import swap
from fused_ema.posthoc import PostHocEma


def weights(ema) -> dict:
    return {k: v.clone() for k, v in ema.state_dict()["weights"].items()}


def assert_loaded(ema, checkpoint):
    assert ema.step == int(checkpoint["step"])
    assert ema.schedule == checkpoint["schedule"]
    for name, value in weights(ema).items():
        assert torch.equal(value, checkpoint["weights"][name]), name


def source_and_target():
    model = small_mlp()
    source = ModelEma(model, decay=0.5, warmup=True)
    for step in range(1, 8):
        source.update(trained(model, 1, seed=step))
    target = ModelEma(model, decay=0.9)
    target.update(trained(model, 1, seed=50))
    return model, copy.deepcopy(source.state_dict()), target


class InterruptAfter:
    """Wraps `fn` so that its `n`-th call raises KeyboardInterrupt once it has run (or, with
    before=True, instead of running)."""

    def __init__(self, fn, n, before=False):
        self.fn, self.n, self.before, self.calls = fn, n, before, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.before and self.calls == self.n:
            raise KeyboardInterrupt
        out = self.fn(*args, **kwargs)
        if not self.before and self.calls == self.n:
            raise KeyboardInterrupt
        return out


@pytest.mark.parametrize("before", [True, False])
def test_an_interrupt_at_the_one_copy_call_still_loads_everything(monkeypatch, before):
    """A load's tensors (the weights, then the schedule's config, counter and weight) are copied
    by one call: an interrupt lands just before it or just after it, and either way the whole
    checkpoint (its schedule options too) ends loaded before it propagates."""
    model, checkpoint, target = source_and_target()
    copy_call = InterruptAfter(torch._foreach_copy_, 1, before)
    monkeypatch.setattr(swap.torch, "_foreach_copy_", copy_call)
    with pytest.raises(KeyboardInterrupt):
        target.load_state_dict(checkpoint)
    monkeypatch.undo()
    assert copy_call.calls == 2  # repeated (it is idempotent): it may have run before the interrupt
    assert_loaded(target, checkpoint)
    target.update(model)  # still usable


@pytest.mark.parametrize("kind", ["ema", "posthoc", "bema"])
def test_a_load_writes_every_tensor_by_one_call(monkeypatch, kind):
    torch.manual_seed(0)
    model = small_mlp()
    make = {
        "ema": lambda: ModelEma(model, decay=0.5),
        "posthoc": lambda: PostHocEma(model, (0.05, 0.1)),
        "bema": lambda: Bema(model, update_freq=1, lag=2),
    }[kind]
    source, target = make(), make()
    for step in range(1, 4):
        source.update(trained(model, 1, seed=step))
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(swap.torch, "_foreach_copy_", lambda *a: calls.append(1) or real(*a))
    checkpoint = copy.deepcopy(source.state_dict())
    target.load_state_dict(checkpoint)
    assert len(calls) == 1
    saved = [checkpoint] if kind == "ema" else checkpoint["emas"]
    for track, state in zip([target] if kind == "ema" else target._tracks, saved, strict=True):
        assert_loaded(track, state)


@pytest.mark.parametrize("kind", ["posthoc", "bema"])
def test_an_interrupt_after_the_one_copy_call_still_loads_every_track(monkeypatch, kind):
    torch.manual_seed(0)
    model = small_mlp()
    make = (
        (lambda: PostHocEma(model, (0.05, 0.1)))
        if kind == "posthoc"
        else (lambda: Bema(model, update_freq=1, lag=2))
    )
    source, target = make(), make()
    for step in range(1, 6):
        source.update(trained(model, 1, seed=step))
    target.update(trained(model, 1, seed=40))
    checkpoint = copy.deepcopy(source.state_dict())
    copy_call = InterruptAfter(torch._foreach_copy_, 1)  # every track's tensors: one call
    monkeypatch.setattr(swap.torch, "_foreach_copy_", copy_call)
    with pytest.raises(KeyboardInterrupt):
        target.load_state_dict(checkpoint)
    monkeypatch.undo()
    assert copy_call.calls == 2
    for track, saved in zip(target._tracks, checkpoint["emas"], strict=True):
        assert_loaded(track, saved)


def test_a_checkpoint_of_the_emas_own_tensors_under_other_names_loads_as_given():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    ema = ModelEma(model, decay=0.5)
    ema.update(model)
    live = ema.state_dict()["weights"]  # aliases of the EMA's own tensors
    before = {k: v.clone() for k, v in live.items()}
    swapped = {**live, "0.weight": live["1.weight"], "1.weight": live["0.weight"]}
    ema.load_state_dict({**ema.state_dict(), "weights": swapped})
    after = weights(ema)
    assert torch.equal(after["0.weight"], before["1.weight"])
    assert torch.equal(after["1.weight"], before["0.weight"])
    assert torch.equal(after["0.bias"], before["0.bias"])
    ema.load_state_dict(ema.state_dict())  # its own, in place: a no-op
    assert all(torch.equal(weights(ema)[k], after[k]) for k in after)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(7), r"head\.weight: shape \[7\]"),
        ("garbage", "head.weight: expected a tensor"),
        (None, "head.weight: expected a tensor"),
        ("other values", "head.weight: tied to embed.weight .* different values"),
    ],
)
def test_every_name_of_a_tied_weight_is_checked(bad, match):
    model = Tied()
    ema = ModelEma(model, decay=0.9)
    ema.update(model)
    state = copy.deepcopy(ema.state_dict())
    if bad == "other values":
        bad = state["weights"]["embed.weight"] + torch.rand(5, 3) + 0.5
    state["weights"]["head.weight"] = bad
    before = weights(ema)
    with pytest.raises(CheckpointError, match=match):
        ema.load_state_dict(state)
    assert all(torch.equal(weights(ema)[k], v) for k, v in before.items())
    state["weights"]["head.weight"] = state["weights"]["embed.weight"].clone()
    ema.load_state_dict(state)  # equal values under both names load


@pytest.mark.parametrize("kind", ["posthoc", "bema"])
def test_a_track_set_refuses_to_load_inside_swapped(kind):
    torch.manual_seed(1)
    model = nn.Linear(4, 2)
    tracked = PostHocEma(model) if kind == "posthoc" else Bema(model, update_freq=1)
    for step in range(1, 5):
        tracked.update(trained(model, 1, seed=step))
    checkpoint = copy.deepcopy(tracked.state_dict())
    tracked.update(trained(model, 1, seed=9))
    own = model.weight.detach().clone()
    swapping = tracked.swapped(model) if kind == "bema" else tracked.emas[0].swapped(model)
    with swapping, pytest.raises(RuntimeError, match="swapped"):
        tracked.load_state_dict(checkpoint)
    assert torch.equal(model.weight, own)


def test_posthoc_checkpoints_carry_their_format_and_older_ones_load():
    model = nn.Linear(4, 2)
    posthoc = PostHocEma(model)
    posthoc.update(model)
    state = copy.deepcopy(posthoc.state_dict())
    assert state["format"] == "fused_ema.posthoc"
    PostHocEma(model).load_state_dict({**state, "format": ""})  # written before the fix
    with pytest.raises(CheckpointError, match="not a PostHocEma state dict"):
        PostHocEma(model).load_state_dict(ModelEma(model).state_dict())


@pytest.mark.parametrize("gammas", [[None, None], ["a", "b"], [float("nan")] * 2, [True, 7]])
def test_posthoc_gammas_of_any_kind_are_checked(gammas):
    model = nn.Linear(4, 2)
    posthoc = PostHocEma(model)
    posthoc.update(model)
    state = copy.deepcopy(posthoc.state_dict())
    state["gammas"] = gammas
    with pytest.raises(CheckpointError, match="gammas"):
        posthoc.load_state_dict(state)


def perturbed(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def snapshot_steps(folder) -> list[int]:
    from safetensors import safe_open

    files = sorted(p for p in folder.iterdir() if "ema0" in p.name)
    return [int(safe_open(str(p), "pt").metadata()["step"]) for p in files]


@pytest.mark.parametrize("after", [0, 3])
def test_posthoc_resumed_writes_the_snapshots_of_an_uninterrupted_run(tmp_path, after):
    def run(folder, updates, state=None, model_state=None):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        if model_state is not None:
            model.load_state_dict(model_state)
        posthoc = PostHocEma(model, update_after_step=after, snapshot_every=4, snapshot_dir=folder)
        if state is not None:
            posthoc.load_state_dict(state)
        for i in updates:
            posthoc.update(perturbed(model, i))
        posthoc.close()
        return posthoc, model

    run(tmp_path / "straight", range(16))
    first, model = run(tmp_path / "resumed", range(6))
    state, model_state = copy.deepcopy(first.state_dict()), copy.deepcopy(model.state_dict())
    run(tmp_path / "resumed", range(6, 16), state, model_state)
    straight = snapshot_steps(tmp_path / "straight")
    assert straight == snapshot_steps(tmp_path / "resumed")
    # t counts from the update that copies the model (step update_after_step + 1)
    assert straight == [t for t in range(1, 16 - after + 1) if t % 4 == 0]
    fused_ema.posthoc.synthesize(tmp_path / "resumed", sigma_rel=0.07)


@pytest.mark.parametrize("kind", ["posthoc", "bema"])
def test_a_track_set_refuses_tracks_that_disagree_with_it(kind):
    torch.manual_seed(2)
    model = nn.Linear(4, 2)
    if kind == "posthoc":
        tracked, other = PostHocEma(model, update_after_step=5), PostHocEma(model)
    else:
        tracked, other = Bema(model, update_freq=1), Bema(model, update_freq=1)
    for step in range(1, 9):
        tracked.update(trained(model, 1, seed=step))
    state = copy.deepcopy(tracked.state_dict())
    if kind == "posthoc":
        with pytest.raises(CheckpointError, match="schedule"):
            other.load_state_dict(state)  # its EMAs copy the model for 5 steps; other's do not
    else:
        bad = copy.deepcopy(state)
        bad["emas"] = bad["emas"][::-1]
        with pytest.raises(CheckpointError, match="schedule"):
            other.load_state_dict(bad)
        bad = copy.deepcopy(state)
        bad["step"] = -5
        with pytest.raises(CheckpointError, match="step"):
            other.load_state_dict(bad)
    bad = copy.deepcopy(state)
    bad["emas"][1]["step"] = torch.tensor(100)
    with pytest.raises(CheckpointError, match="different steps"):
        tracked.load_state_dict(bad)
    assert [t.step for t in tracked._tracks] == [8] * len(tracked._tracks)
    tracked.load_state_dict(state)


def test_a_posthoc_checkpoint_whose_gammas_differ_in_the_last_bits_loads():
    """A gamma computed from sigma_rel on another machine may differ in its last bits."""
    torch.manual_seed(5)
    model = nn.Linear(4, 2)
    posthoc = PostHocEma(model, (0.05, 0.1))
    for step in range(1, 4):
        posthoc.update(trained(model, 1, seed=step))
    state = copy.deepcopy(posthoc.state_dict())
    state["gammas"] = [g * (1 + 1e-13) for g in state["gammas"]]
    for track in state["emas"]:
        kind, gamma = track["schedule"]["warmup"]
        track["schedule"]["warmup"] = (kind, gamma * (1 + 1e-13))
    fresh = PostHocEma(model, (0.05, 0.1))
    fresh.load_state_dict(state)
    assert [t.step for t in fresh.emas] == [3, 3]


class RefusesCopy(torch.Tensor):
    """A tensor subclass whose copy raises: the load's one copy call fails, writing nothing."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if "copy" in getattr(func, "__name__", ""):
            raise RuntimeError(f"RefusesCopy refuses {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_load_whose_copy_fails_leaves_the_settings_as_they_were():
    """The settings (schedule options) are applied only once the tensors have landed: they once
    took the checkpoint's decay while the schedule's config tensor kept the old one."""
    model, checkpoint, target = source_and_target()
    checkpoint["weights"]["0.weight"] = torch.randn(16, 6).as_subclass(RefusesCopy)
    before, step, schedule = weights(target), target.step, target.schedule
    assert checkpoint["schedule"] != schedule
    with pytest.raises(RuntimeError, match="RefusesCopy refuses"):
        target.load_state_dict(checkpoint)
    assert target.step == step and target.schedule == schedule
    assert all(torch.equal(weights(target)[k], v) for k, v in before.items())
    target.update(trained(model, 1, seed=77))  # still usable


def _unchanged(ema, before_weights, before_step):
    assert ema.step == before_step
    for name, value in weights(ema).items():
        assert torch.equal(value, before_weights[name]), name


def test_uint64_values_past_int64_are_refused_not_wrapped():
    model, checkpoint, target = source_and_target()
    before, step = weights(target), target.step
    big = torch.tensor(2**63 + 5, dtype=torch.uint64)
    checkpoint["weights"]["1.num_batches_tracked"] = big
    with pytest.raises(
        CheckpointError, match="1.num_batches_tracked: values past 9223372036854775807"
    ):
        target.load_state_dict(checkpoint)
    _unchanged(target, before, step)


class _TiedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("order", [("head.weight", "emb.weight"), ("emb.weight", "head.weight")])
def test_strict_false_loads_the_name_of_a_tie_that_fits_whatever_the_key_order(order):
    ema = ModelEma(_TiedEmbedding(), 0.9)
    good = torch.randn(6, 4)
    values = {"head.weight": torch.randn(3, 3), "emb.weight": good}  # head.weight: wrong shape
    result = ema.load_state_dict(
        {**ema.state_dict(), "weights": {k: values[k] for k in order}}, False
    )
    assert torch.equal(ema.module.emb.weight, good)
    assert result.mismatched_keys == ["head.weight"] and result.missing_keys == []


def test_a_precision_warning_raised_as_an_error_leaves_the_ema_unloaded():
    model = small_mlp()
    with pytest.warns(fused_ema.PrecisionWarning):
        source = ModelEma(model, 0.999, dtype=torch.bfloat16, stochastic_rounding=False)
    source.update(trained(model, 1, seed=3), step=5)
    target = ModelEma(model, 0.999, dtype=torch.bfloat16)  # stochastic rounding: no warning
    before, step = weights(target), target.step
    with warnings.catch_warnings(), pytest.raises(fused_ema.PrecisionWarning):
        warnings.simplefilter("error")  # as pytest -W error, python -W error
        target.load_state_dict(source.state_dict())
    _unchanged(target, before, step)
    assert target.stochastic_rounding is True


def _freed_step():
    step = torch.tensor([7, 8], dtype=torch.int64)[1:]
    step.untyped_storage().resize_(0)
    return step


@pytest.mark.parametrize("call", ["load step=", "ema.step =", "update step=", "checkpoint step"])
def test_a_freed_step_tensor_is_refused_by_name(call):
    model, checkpoint, target = source_and_target()
    before, step = weights(target), target.step
    error = CheckpointError if call == "checkpoint step" else ValueError
    with pytest.raises(error, match="step'? is a tensor whose memory was freed"):
        if call == "load step=":
            target.load_state_dict(checkpoint, step=_freed_step())
        elif call == "ema.step =":
            target.step = _freed_step()
        elif call == "update step=":
            target.update(model, step=_freed_step())
        else:
            target.load_state_dict({**checkpoint, "step": _freed_step()})
    _unchanged(target, before, step)


def test_loading_one_track_of_a_set_is_refused():
    model = small_mlp()
    posthoc = PostHocEma(model, sigma_rels=(0.05, 0.1))
    posthoc.update(trained(model, 1, seed=4))
    plain = ModelEma(model, 0.9)
    before = weights(posthoc[0])
    with pytest.raises(RuntimeError, match="load_state_dict on one of a PostHocEma's tracks"):
        posthoc[0].load_state_dict(plain.state_dict())
    _unchanged(posthoc[0], before, 1)
    posthoc.load_state_dict(posthoc.state_dict())  # the set's own checkpoint still loads


def test_a_positional_checkpoint_into_a_copy_with_ignore_names_says_what_to_do():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ema = ModelEma(model, 0.9, buffers="ignore", ignore_names=["0.bias"])
    positional = {"shadow_params": [p.detach() + 1 for p in model.parameters()], "decay": 0.9}
    copied = copy.deepcopy(ema)
    with pytest.raises(CheckpointError, match=r"ema.update\(model\) or ema.resync\(model\) first"):
        copied.load_state_dict(positional)
    copied.resync(model)
    copied.load_state_dict(positional)
    assert torch.equal(copied.module[1].weight, model[1].weight + 1)


def test_a_load_result_unpacks_as_torchs():
    model, checkpoint, target = source_and_target()
    del checkpoint["weights"]["0.bias"]
    missing, unexpected = target.load_state_dict(checkpoint, strict=False)
    assert (missing, unexpected) == (["0.bias"], [])
    result = target.load_state_dict(checkpoint, strict=False)
    assert result.format == "fused_ema" and result.mismatched_keys == []
    assert copy.deepcopy(result) == result and result != fused_ema.LoadResult(
        "x", ["0.bias"], [], []
    )
