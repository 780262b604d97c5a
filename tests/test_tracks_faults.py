"""All or nothing across tracks: a PostHocEma or Bema update (several ModelEmas updated by one
fused pass) interrupted at any point leaves every track bitwise as before, or every track as one
uninterrupted update leaves it, blocking or non_blocking, and the object keeps working."""

import copy

import pytest
import torch
from interrupts import (
    InterruptAt,
    InterruptAtLine,
    ignore_dropped,
    interrupted_everywhere,
    interrupted_updates,
)
from torch import nn

from fused_ema import Bema
from fused_ema.posthoc import PostHocEma


def model_and_tracked(kind):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 3)).double()
    if kind == "bema":
        tracked = Bema(model, update_freq=1, lag=2)
    else:
        tracked = PostHocEma(model, (0.05, 0.1, 0.2))
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        tracked.update(model)
    return model, tracked


def tracks_of(tracked) -> list:
    return [
        (t.step, {k: v.clone() for k, v in t.state_dict()["weights"].items()})
        for t in tracked._tracks
    ]


def assert_same_tracks(a, b):
    for (step_a, weights_a), (step_b, weights_b) in zip(tracks_of(a), tracks_of(b), strict=True):
        assert step_a == step_b
        assert weights_a.keys() == weights_b.keys()
        for name, value in weights_a.items():
            assert torch.equal(value, weights_b[name]), name


@ignore_dropped
@pytest.mark.parametrize("point", [InterruptAt, InterruptAtLine], ids=["call", "line"])
@pytest.mark.parametrize("non_blocking", [False, True], ids=["blocking", "non_blocking"])
@pytest.mark.parametrize("kind", ["posthoc", "bema"])
def test_an_interrupt_anywhere_in_a_joined_update_is_all_or_nothing_across_tracks(
    kind, non_blocking, point
):
    model, tracked = model_and_tracked(kind)
    twin = copy.deepcopy(tracked)  # updated, uninterrupted, whenever tracked's update went through

    def went_through(interrupted):
        tracked.synchronize()
        steps = {t.step for t in tracked._tracks}
        assert len(steps) == 1, f"the tracks went apart: {steps}"
        moved = tracked._tracks[0].step != twin._tracks[0].step
        if moved:
            twin.update(model)
        assert_same_tracks(tracked, twin)
        return moved

    update = lambda: tracked.update(model, non_blocking=non_blocking)  # noqa: E731
    fired = interrupted_updates(update, model, went_through, seed=12, point=point)
    assert len(fired) > 20, len(fired)


@pytest.mark.parametrize("kind, fused", [("posthoc", "lerp_many_"), ("bema", "bema_")])
def test_an_interrupt_before_the_fused_write_leaves_every_track_as_it_was(kind, fused, monkeypatch):
    import fused_ema._update.plan as plan
    import fused_ema._update.prepared as prepared

    model, tracked = model_and_tracked(kind)
    before = tracks_of(tracked)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan, fused, interrupted)
    monkeypatch.setattr(prepared.Prepared, "run", interrupted)  # a prepared update's one call
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        tracked.update(model)
    monkeypatch.undo()
    for (step, weights), (step_before, weights_before) in zip(tracks_of(tracked), before):
        assert step == step_before == 3
        for name, value in weights_before.items():
            assert torch.equal(value, weights[name]), name
    tracked.update(model)  # and it goes on from there, every track one step on
    assert [t.step for t in tracked._tracks] == [4] * len(tracked._tracks)


def _snapshot_run(folder, interrupt_at=None):
    """Eight updates of a PostHocEma snapshotting every 2 into `folder`; update 4 (a snapshot's)
    interrupted at `interrupt_at`'s point, and done again if it did not go through. Returns the
    folder's files as {name: (step, tensors)}, and whether an interrupt fired."""
    from safetensors import safe_open

    g = torch.Generator().manual_seed(3)
    values = [(torch.randn(3, 2, generator=g), torch.randn(3, generator=g)) for _ in range(8)]
    torch.manual_seed(0)
    model = nn.Linear(2, 3)
    ema = PostHocEma(model, sigma_rels=(0.05, 0.1), snapshot_every=2, snapshot_dir=folder)
    fired, t = False, 1
    while t <= 8:
        with torch.no_grad():
            model.weight.copy_(values[t - 1][0])
            model.bias.copy_(values[t - 1][1])
        before = ema.step
        if t == 4 and interrupt_at is not None:
            InterruptAt.install(interrupt_at)
            try:
                ema.update(model)
            except KeyboardInterrupt:
                fired = True
            finally:
                InterruptAt.install(None)
            interrupt_at = None
        else:
            ema.update(model)
        t += ema.step != before
    ema.synchronize()
    files = {}
    for path in sorted(folder.iterdir()):
        with safe_open(str(path), "pt") as f:
            files[path.name] = (f.metadata()["step"], {k: f.get_tensor(k) for k in f.keys()})
    return files, fired


@ignore_dropped
def test_an_interrupt_anywhere_in_a_snapshot_update_leaves_the_folder_of_an_uninterrupted_run(
    tmp_path,
):
    """docs/guarantees.md: an interrupt that lands once the update has written lets it finish:
    for a PostHocEma that includes its snapshot. Every point of the update at a snapshot step,
    interrupted, then the run continued: the same files, steps and tensors as a run never
    interrupted (they once lost that snapshot, or labelled every later one a step behind)."""
    expected, _ = _snapshot_run(tmp_path / "reference")
    assert [step for step, _ in expected.values()] == ["2", "2", "4", "4", "6", "6", "8", "8"]
    for n in range(1, 10_000):
        got, fired = _snapshot_run(tmp_path / f"run{n}", InterruptAt(n))
        assert got.keys() == expected.keys(), n
        for name, (step, tensors) in expected.items():
            assert got[name][0] == step, (n, name)
            for key, value in tensors.items():
                assert torch.equal(got[name][1][key], value), (n, name, key)
        if not fired:
            break
    assert n > 50


@ignore_dropped
@pytest.mark.parametrize("point", [InterruptAt, InterruptAtLine], ids=["call", "line"])
@pytest.mark.parametrize("kind", ["posthoc", "bema"])
def test_an_interrupt_anywhere_in_a_resync_moves_every_track_or_none(kind, point):
    model, base = model_and_tracked(kind)
    model.append(nn.Linear(3, 2).double())  # a structure the tracks do not have yet
    names = lambda t: [sorted(track.state_dict()["weights"]) for track in t._tracks]  # noqa: E731
    before = names(base)
    current, outcomes = [copy.deepcopy(base)], set()

    def after_each(interrupted):
        now = names(current[0])
        assert all(n == now[0] for n in now), "the tracks went apart"
        outcomes.add(now != before)
        if now != before:  # it went through: each track now averages the new layer too
            current[0].update(model)
            assert {t.step for t in current[0]._tracks} == {4}
        current[0] = copy.deepcopy(base)

    fired = interrupted_everywhere(lambda: current[0].resync(model), after_each, point=point)
    assert outcomes == {False, True} and len(fired) > 5, (outcomes, len(fired))


@pytest.mark.parametrize("kind", ["posthoc", "bema"])
def test_a_track_resyncs_only_with_its_set(kind):
    model, tracked = model_and_tracked(kind)
    model.append(nn.Linear(3, 2).double())
    before = tracks_of(tracked)
    with pytest.raises(RuntimeError, match="tracks: they update together"):
        tracked._tracks[1].resync(model)
    for (step, weights), (step_before, weights_before) in zip(tracks_of(tracked), before):
        assert step == step_before and weights.keys() == weights_before.keys()
    tracked.resync(model)
    assert all("3.weight" in weights for _, weights in tracks_of(tracked))
