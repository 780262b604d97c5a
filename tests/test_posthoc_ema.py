"""PostHocEma, the training-time half of post-hoc EMA: its tracked EMAs against an independent
float64 implementation of EDM2's power-function EMA over a real training run, against the real
ema-pytorch KarrasEMA, snapshots on disk, checkpoints (all or nothing, exact resume with the
snapshot numbering) and the refusals that keep another run's snapshots safe."""

import copy
import math

import pytest
import torch
from torch import nn
from track_helpers import fused_passes, net, train

import fused_ema
from conftest import DEVICES
from fused_ema.errors import CheckpointError
from fused_ema.posthoc import PostHocEma


def gamma_of(sigma_rel: float) -> float:
    """EDM2's sigma_rel -> gamma, independently: the largest real root of its cubic, by bisection
    on sigma_rel(gamma), which falls as gamma grows."""

    def sigma(g):
        return math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3)))

    lo, hi = -1 + 1e-12, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sigma(mid) > sigma_rel else (lo, mid)
    return (lo + hi) / 2


class PowerEma:
    """EDM2's power-function EMA in float64, written from the paper: beta_t = (1 - 1/t)^(g+1)."""

    def __init__(self, model, gamma):
        self.gamma = gamma
        self.state = {n: v.detach().double().clone() for n, v in model.state_dict().items()}

    def update(self, model, t):
        beta = (1 - 1 / t) ** (self.gamma + 1)
        for n, v in model.state_dict().items():
            if v.is_floating_point():
                self.state[n] = beta * self.state[n] + (1 - beta) * v.detach().double()
            else:
                self.state[n] = v.detach().clone()


def max_rel_error(ema: fused_ema.ModelEma, ref: PowerEma) -> float:
    weights = ema.state_dict()["weights"]
    worst = 0.0
    for name, value in ref.state.items():
        if value.is_floating_point():
            scale = value.abs().max().clamp_min(1e-12)
            worst = max(worst, float((weights[name].double().cpu() - value).abs().max() / scale))
        else:
            assert torch.equal(weights[name].cpu(), value.cpu()), name
    return worst


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_tracked_emas_follow_the_papers_power_function_over_a_training_run(device, model_dtype):
    model = net(model_dtype, device)
    sigma_rels = (0.05, 0.10, 0.2)
    ph = PostHocEma(model, sigma_rels)
    refs = [PowerEma(model, gamma_of(s)) for s in sigma_rels]
    assert [ema.state_dict()["weights"]["0.weight"].dtype for ema in ph.emas] == [torch.float32] * 3

    def step(t):
        ph.update(model)
        for ref in refs:
            ref.update(model, t)

    train(model, 60, step, device=device)
    for k, (ema, ref) in enumerate(zip(ph.emas, refs)):
        assert ph.gammas[k] == pytest.approx(ref.gamma, rel=1e-9)
        assert max_rel_error(ema, ref) < 1e-5, f"EMA {k} (sigma_rel {sigma_rels[k]})"
    assert ph.step == 60


def test_equals_ema_pytorchs_karras_ema_where_its_settings_match():
    ema_pytorch = pytest.importorskip("ema_pytorch")
    model = net()
    karras = ema_pytorch.KarrasEMA(model, sigma_rel=0.07, update_every=1)
    ph = PostHocEma(model, (0.07,))
    # KarrasEMA copies at its first update and then counts t from 3 (its beta is
    # (1 - 1/(n + 1)) ** (gamma + 1) at update n); the same t through update(step=).
    train(model, 40, lambda t: (karras.update(), ph.update(model, step=1 if t == 1 else t + 1)))
    ours = ph.emas[0].state_dict()["weights"]
    theirs = karras.ema_model.state_dict()
    for name, value in theirs.items():
        if value.is_floating_point():
            assert torch.allclose(ours[name], value, rtol=1e-6, atol=1e-6), name
    assert ph.gammas[0] == pytest.approx(karras.gamma, rel=1e-9)


def test_one_update_reads_the_model_once_for_every_ema():
    """The tracks update through one lerp_many_ pass per device, not one lerp_ per EMA."""
    model = net()
    ph = PostHocEma(model, (0.05, 0.1, 0.15, 0.2))
    passes = fused_passes(lambda: train(model, 3, lambda t: ph.update(model)))
    assert passes == ["lerp_many_"] * 3


def test_a_track_cannot_update_alone_and_the_tracks_stay_in_step():
    model = net()
    ph = PostHocEma(model, (0.05, 0.1))
    ph.update(model)
    before = [e.state_dict()["weights"]["0.weight"].clone() for e in ph.emas]
    with pytest.raises(RuntimeError, match="PostHocEma"):
        ph.emas[1].update(model)
    assert [e.step for e in ph.emas] == [1, 1]
    assert all(
        torch.equal(b, e.state_dict()["weights"]["0.weight"]) for b, e in zip(before, ph.emas)
    )


def weights_of(tracks) -> list:
    return [{k: v.clone() for k, v in t.state_dict()["weights"].items()} for t in tracks]


def same_weights(before, tracks) -> bool:
    return all(
        all(torch.equal(v, t.state_dict()["weights"][k]) for k, v in b.items())
        for b, t in zip(before, tracks)
    )


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
        lambda e, model, opt: e.to(torch.float64),  # accepted, then every update of the set failed
        lambda e, model, opt: e.half(),
    ],
    ids=[
        "update",
        "attach",
        "decay",
        "min_decay",
        "update_every",
        "update_after_step",
        "step",
        "to",
        "half",
    ],  # fmt: skip
)
@pytest.mark.parametrize("k", [0, 1])
def test_no_track_updates_attaches_or_changes_its_schedule_alone(tmp_path, change, k):
    """The first track too: its update moved every track but wrote no snapshot, and a setter put
    the tracks out of step (a checkpoint that no longer loads)."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path)
    ph.update(model)
    before, schedules = weights_of(ph.emas), [e.schedule for e in ph.emas]
    with pytest.raises(RuntimeError, match="one of a PostHocEma's tracks"):
        change(ph.emas[k], model, opt)
    train(model, 2, lambda t: None)  # an attached hook would update (or raise) here
    assert [e.step for e in ph.emas] == [1, 1]
    assert [e.schedule for e in ph.emas] == schedules
    assert same_weights(before, ph.emas)
    assert not list(tmp_path.iterdir())
    ph.update(model)  # still one set: the snapshot of update 2
    PostHocEma(net(), (0.05, 0.1)).load_state_dict(ph.state_dict())
    ph.close()
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_the_set_converts_and_moves_its_tracks_together():
    """ph.double() and friends went through nn.Module's _apply, which leaves the tracks where
    they are: they returned the set unconverted."""
    model = net()
    ph = PostHocEma(model, (0.05, 0.1))
    ph.update(model)
    for convert, dtype in ((ph.double, torch.float64), (ph.half, torch.float16),
                           (ph.float, torch.float32), (ph.cpu, torch.float32)):  # fmt: skip
        assert convert() is ph
        for e in ph.emas:
            assert {t.dtype for t in e.module.parameters()} == {dtype}
    ph.update(model)
    assert [e.step for e in ph.emas] == [2, 2]


@pytest.mark.parametrize("tensor", [False, True], ids=["int", "tensor"])
def test_a_snapshot_step_that_does_not_grow_is_refused_before_anything_changes(tmp_path, tensor):
    """update(step=) back at or below the last snapshot's update count, where it would write one,
    made the folder unusable for synthesis (a step that does not grow)."""
    model = net()
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=4, snapshot_dir=tmp_path)
    for s in (1, 4, 8):
        ph.update(model, step=torch.tensor(s) if tensor else s)
    ph.synchronize()
    before, files = weights_of(ph.emas), sorted(tmp_path.iterdir())
    for s in (4, 8):
        with pytest.raises(ValueError, match="snapshot steps must grow"):
            ph.update(model, step=torch.tensor(s) if tensor else s)
        ph.synchronize()
        assert [e.step for e in ph.emas] == [8, 8] and sorted(tmp_path.iterdir()) == files
        assert same_weights(before, ph.emas)
    ph.update(model, step=5)  # a lower step that writes no snapshot is the caller's to give
    with pytest.raises(ValueError, match="snapshot steps must grow"):
        ph.save_snapshot()
    ph.synchronize()
    assert sorted(tmp_path.iterdir()) == files
    ph.update(model, step=12)
    assert ph.synthesize(0.07)  # the folder is still usable


def test_snapshots_are_written_every_n_updates_with_their_metadata(tmp_path):
    from safetensors import safe_open

    model = net()
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=4, snapshot_dir=tmp_path)
    train(model, 10, lambda t: ph.update(model))
    ph.synchronize()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"{i:06d}-ema{k}.safetensors" for i in range(2) for k in range(2)]
    with safe_open(str(tmp_path / "000001-ema1.safetensors"), "pt") as f:
        meta = f.metadata()
        assert int(meta["step"]) == 8 and int(meta["ema_index"]) == 1 and int(meta["index"]) == 1
        assert float(meta["gamma"]) == pytest.approx(ph.gammas[1])
        assert f.get_tensor("0.weight").dtype == torch.float16
        assert f.get_tensor("1.num_batches_tracked").dtype == torch.int64
    ph.close()


def test_snapshots_taken_just_before_the_interpreter_exits_are_written(tmp_path):
    """The snapshot worker is a daemon thread; fused_ema waits for its queue at exit, so a script
    whose last update takes a snapshot (non_blocking too) still finds its files complete."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    script = f"""
import torch
from torch import nn
from fused_ema.posthoc import PostHocEma
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
ph = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir={str(tmp_path)!r})
for step in range(4):
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ph.update(model, non_blocking=step % 2 == 1)
torch.save(model.state_dict(), {str(tmp_path / "model.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"{i:06d}-ema{k}.safetensors" for i in range(2) for k in range(2)]
    last = load_file(str(tmp_path / "000001-ema0.safetensors"))
    model = torch.load(tmp_path / "model.pt")
    # weight 0 rose by 1 per update: its EMA lies strictly between the first and last values
    assert 0 < (model["0.weight"] - last["0.weight"].float()).mean() < 3


def test_the_last_snapshot_holds_the_ema_of_its_step(tmp_path):
    from safetensors.torch import load_file

    model = net()
    ph = PostHocEma(model, (0.1,), snapshot_every=5, snapshot_dir=tmp_path, snapshot_dtype=None)
    train(model, 10, lambda t: ph.update(model))
    ph.synchronize()
    saved = load_file(str(tmp_path / "000001-ema0.safetensors"))
    for name, value in ph.emas[0].state_dict()["weights"].items():
        assert torch.equal(saved[name], value), name


def test_save_snapshot_at_a_step_that_has_one_keeps_the_folder_usable(tmp_path):
    """save_snapshot() after the periodic snapshot of the same update (the end of a run), or twice,
    wrote a second snapshot of that step, and synthesis refused the whole folder; before the first
    update it failed only later, on the writer, having used up a snapshot index."""
    from fused_ema.posthoc import list_snapshots, synthesize

    model = net()
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=4, snapshot_dir=tmp_path)
    with pytest.raises(ValueError, match="no update has started the EMAs"):
        ph.save_snapshot()
    train(model, 8, lambda t: ph.update(model))
    ph.save_snapshot()  # step 8: the periodic snapshot is there
    train(model, 2, lambda t: ph.update(model))
    ph.save_snapshot()
    ph.save_snapshot()
    ph.close()
    assert [(s.index, s.step) for s in list_snapshots(tmp_path)] == [
        (i, t) for i, t in enumerate((4, 8, 10)) for _ in range(2)
    ]
    state = synthesize(tmp_path, sigma_rel=0.1)  # gamma of EMA 1: its own weights
    for name, value in ph.emas[1].state_dict()["weights"].items():
        torch.testing.assert_close(state[name], value, rtol=2e-3, atol=2e-3)
    resumed = PostHocEma(model, (0.05, 0.1), snapshot_every=4, snapshot_dir=tmp_path / "b")
    train(model, 4, lambda t: resumed.update(model))
    resumed.load_state_dict(copy.deepcopy(resumed.state_dict()))
    resumed.save_snapshot()  # at step 4, which a checkpoint taken then has snapshotted
    resumed.close()
    assert len(list_snapshots(tmp_path / "b")) == 2


def test_a_snapshot_interrupted_before_it_was_queued_can_be_taken_again(tmp_path, monkeypatch):
    import fused_ema.posthoc.snapshots as snapshots
    from fused_ema.posthoc import list_snapshots

    model, metadata = net(), snapshots.snapshot_metadata
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path)
    ph.update(model)

    def interrupted(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(snapshots, "snapshot_metadata", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ph.update(model)
    monkeypatch.setattr(snapshots, "snapshot_metadata", metadata)
    ph.save_snapshot()
    ph.close()
    assert [(s.step, s.ema_index) for s in list_snapshots(tmp_path)] == [(2, 0), (2, 1)]


def test_a_fresh_run_refuses_a_folder_with_another_runs_snapshots_and_changes_nothing(tmp_path):
    model = net()
    first = PostHocEma(model, (0.1,), snapshot_every=2, snapshot_dir=tmp_path)
    train(model, 4, lambda t: first.update(model))
    first.close()
    second = PostHocEma(model, (0.1,), snapshot_every=2, snapshot_dir=tmp_path)
    second.update(model)
    before = second.emas[0].state_dict()["weights"]["0.weight"].clone()
    with pytest.raises(RuntimeError, match="already holds 2 snapshots"):
        second.update(model)
    assert second.step == 1
    assert torch.equal(before, second.emas[0].state_dict()["weights"]["0.weight"])


def test_a_second_run_refuses_a_folder_whose_first_snapshots_are_still_queued(tmp_path):
    """A second PostHocEma in the process counted only the files on disk: it took the folder while
    the first's snapshot was queued, both wrote snapshot 0, and its clean-up of temporary files
    removed the first's file mid-write."""
    from fused_ema.posthoc import list_snapshots

    model = net()
    first = PostHocEma(model, (0.05, 0.1), snapshot_every=1, snapshot_dir=tmp_path)
    second = PostHocEma(model, (0.05, 0.1), snapshot_every=1, snapshot_dir=tmp_path)
    for _ in range(20):  # a write is on the worker (or queued) when the second one checks
        first.update(model)
    with pytest.raises(RuntimeError, match="already holds 20 snapshots"):
        second.update(model)
    assert second.step == 0
    first.close()
    assert [(s.index, s.step) for s in list_snapshots(tmp_path)] == [
        (i, i + 1) for i in range(20) for _ in range(2)
    ]


def test_a_resumed_run_continues_bit_for_bit_and_continues_the_numbering(tmp_path):
    model = net()
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=3, snapshot_dir=tmp_path / "a")
    train(model, 7, lambda t: ph.update(model))
    checkpoint = copy.deepcopy(ph.state_dict())
    model_state = copy.deepcopy(model.state_dict())
    train(model, 5, lambda t: ph.update(model), seed=9)
    ph.synchronize()

    model2 = net()
    model2.load_state_dict(model_state)
    resumed = PostHocEma(model2, (0.05, 0.1), snapshot_every=3, snapshot_dir=tmp_path / "a")
    resumed.load_state_dict(checkpoint)
    assert resumed.step == 7
    train(model2, 5, lambda t: resumed.update(model2), seed=9)
    resumed.synchronize()
    for a, b in zip(ph.emas, resumed.emas):
        for name, value in a.state_dict()["weights"].items():
            assert torch.equal(value, b.state_dict()["weights"][name]), name
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == [f"{i:06d}-ema{k}.safetensors" for i in range(4) for k in range(2)]


def test_a_resumed_run_synthesizes_from_its_own_snapshots_only(tmp_path):
    """The folder still holds the later snapshots of the run it resumed until it replaces them;
    PostHocEma.synthesize used them (and their last step by default): another run's EMA."""
    from fused_ema.posthoc import SnapshotError, list_snapshots, synthesize

    model = net()
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path)
    with pytest.raises(SnapshotError, match="holds no snapshots of this run"):
        ph.synthesize(0.1)
    train(model, 4, lambda t: ph.update(model))
    checkpoint, model_state = copy.deepcopy(ph.state_dict()), copy.deepcopy(model.state_dict())
    train(model, 6, lambda t: ph.update(model), seed=3)
    ph.close()
    model.load_state_dict(model_state)
    resumed = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path)
    resumed.load_state_dict(checkpoint)
    train(model, 2, lambda t: resumed.update(model), seed=4)  # other data: another EMA
    resumed.synchronize()  # its snapshot of step 6 on disk before the folder is listed here
    assert max(s.step for s in list_snapshots(tmp_path)) == 10  # (the abandoned run's)
    mine = [s for s in list_snapshots(tmp_path) if s.index < 3]
    expected = synthesize(mine, sigma_rel=0.07)
    got = resumed.synthesize(0.07)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    direct = resumed.emas[1].state_dict()["weights"]  # sigma_rel 0.1 at step 6: EMA 1 itself
    for name, value in resumed.synthesize(0.1).items():
        torch.testing.assert_close(value, direct[name], rtol=2e-3, atol=2e-3)
    resumed.close()


def test_a_damaged_checkpoint_is_refused_whole_and_changes_nothing():
    model = net()
    ph = PostHocEma(model, (0.05, 0.1))
    train(model, 3, lambda t: ph.update(model))
    good = ph.state_dict()
    other = PostHocEma(model, (0.05, 0.1))
    other.update(model)
    before = [copy.deepcopy(e.state_dict()) for e in other.emas]
    bad = copy.deepcopy(good)
    bad["emas"][1]["weights"]["0.weight"] = torch.zeros(3, 3)  # the second EMA's is wrong
    with pytest.raises(CheckpointError, match="ema1"):
        other.load_state_dict(bad)
    wrong_gammas = copy.deepcopy(good)
    wrong_gammas["gammas"] = [1.0, 2.0]
    with pytest.raises(CheckpointError, match="gammas"):
        other.load_state_dict(wrong_gammas)
    for index in (None, -1, 2.5, True, "3", torch.tensor([1, 2])):
        wrong_index = {**good, "snapshot_index": index}
        with pytest.raises(CheckpointError, match="snapshot_index"):
            other.load_state_dict(wrong_index)
    with pytest.raises(CheckpointError, match="PostHocEma"):
        other.load_state_dict(good["emas"][0])
    for key in ("format", "format_version"):  # an array there once raised "ambiguous" RuntimeError
        with pytest.raises(CheckpointError, match="format"):
            other.load_state_dict({**good, key: torch.ones(2, dtype=torch.int64)})
    for b, e in zip(before, other.emas):
        assert e.step == 1
        for name, value in b["weights"].items():
            assert torch.equal(value, e.state_dict()["weights"][name]), name


def test_inside_a_parent_modules_state_dict_it_round_trips(tmp_path):
    """...and a parent's load checks the widths the tracks were saved with (through torch.save
    too): they reached the tracks' checks only in a load of the PostHocEma itself, so a parent's
    load took EMAs of other widths under this one's gammas (its snapshots then mislabelled)."""

    class Holder(nn.Module):
        def __init__(self, model, sigma_rels=(0.05, 0.1)):
            super().__init__()
            self.model = model
            self.ema = PostHocEma(model, sigma_rels)

    model = net()
    holder = Holder(model)
    train(model, 4, lambda t: holder.ema.update(model))
    state = holder.state_dict()
    assert "ema.ema1.weights.0.weight" in state and "ema.snapshot_index" in state
    other = Holder(net())
    other.load_state_dict(state)
    for a, b in zip(holder.ema.emas, other.ema.emas):
        assert a.step == b.step == 4
        assert torch.equal(a.state_dict()["weights"]["3.bias"], b.state_dict()["weights"]["3.bias"])
    torch.save(state, tmp_path / "holder.pt")
    wider = Holder(net(), (0.2, 0.25))
    before = [e.state_dict()["weights"]["3.bias"].clone() for e in wider.ema.emas]
    with pytest.raises(RuntimeError, match=r"ema: gammas .* this PostHocEma tracks"):
        wider.load_state_dict(torch.load(tmp_path / "holder.pt", weights_only=True))
    assert all(e.step == 0 for e in wider.ema.emas)
    assert all(
        torch.equal(b, e.state_dict()["weights"]["3.bias"]) for b, e in zip(before, wider.ema.emas)
    )


def test_bad_arguments_are_refused_clearly():
    model = net()
    with pytest.raises(ValueError, match="gamma"):
        PostHocEma(model, gammas=(-2.0,))
    with pytest.raises(ValueError, match="at least one"):
        PostHocEma(model, ())
    # Accepted, they made a folder its own synthesis refused ("the same gamma at the same step").
    with pytest.raises(ValueError, match="the widths must differ"):
        PostHocEma(model, (0.05, 0.10, 0.05))
    with pytest.raises(ValueError, match="snapshot_every"):
        PostHocEma(model, snapshot_every=0)
    with pytest.raises(ValueError, match="snapshot_dtype"):
        PostHocEma(model, snapshot_dtype=torch.int8)


def test_a_copy_keeps_its_tracks_updating_together():
    model = net()
    ph = PostHocEma(model, (0.05, 0.1))
    ph.update(model)
    twin = copy.deepcopy(ph)
    train(model, 2, lambda t: (ph.update(model), twin.update(model)))
    for a, b in zip(ph.emas, twin.emas):
        assert b.step == 3
        assert torch.equal(
            a.state_dict()["weights"]["0.weight"], b.state_dict()["weights"]["0.weight"]
        )


def test_non_blocking_updates_and_their_snapshots_equal_blocking_ones(tmp_path):
    from safetensors.torch import load_file

    model = net()
    blocking = PostHocEma(model, (0.05, 0.1), snapshot_every=3, snapshot_dir=tmp_path / "b")
    later = PostHocEma(model, (0.05, 0.1), snapshot_every=3, snapshot_dir=tmp_path / "n")
    train(model, 9, lambda t: (blocking.update(model), later.update(model, non_blocking=True)))
    later.synchronize()
    blocking.synchronize()
    for a, b in zip(blocking.emas, later.emas):
        for name, value in a.state_dict()["weights"].items():
            assert torch.equal(value, b.state_dict()["weights"][name]), name
    for i in range(3):
        for k in range(2):
            a = load_file(str(tmp_path / "b" / f"{i:06d}-ema{k}.safetensors"))
            b = load_file(str(tmp_path / "n" / f"{i:06d}-ema{k}.safetensors"))
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_snapshot_that_cannot_be_written_is_reported_by_the_next_call(tmp_path, monkeypatch):
    import fused_ema.posthoc.snapshots as snapshots

    def broken(path, tensors, metadata):
        raise OSError("disk full")

    monkeypatch.setattr(snapshots, "write_snapshot", broken)
    model = net()
    ph = PostHocEma(model, (0.1,), snapshot_every=1, snapshot_dir=tmp_path)
    ph.update(model)
    with pytest.raises(
        RuntimeError, match=r"000000-ema0.safetensors \(update count 1\).*disk full"
    ):
        ph.synchronize()
    assert not any(p.suffix == ".safetensors" for p in tmp_path.iterdir())


def test_state_dict_counts_only_snapshots_on_disk(tmp_path, monkeypatch):
    """A checkpoint taken while snapshots were still being written counted them, written or not:
    state_dict() waits for them, and raises a failed one (the next call does, as documented)."""
    import threading

    import fused_ema.posthoc.snapshots as snapshots

    write, gate, fail = snapshots.write_snapshot, threading.Event(), []

    def slow(path, tensors, metadata):
        gate.wait(5)
        if fail:
            raise OSError("disk full")
        write(path, tensors, metadata)

    monkeypatch.setattr(snapshots, "write_snapshot", slow)
    model = net()
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=1, snapshot_dir=tmp_path)
    ph.update(model)
    threading.Timer(0.3, gate.set).start()
    state = ph.state_dict()
    assert state["snapshot_index"] == 1
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "000000-ema0.safetensors",
        "000000-ema1.safetensors",
    ]
    gate.clear()
    fail.append(True)
    train(model, 1, lambda t: ph.update(model))
    threading.Timer(0.3, gate.set).start()
    with pytest.raises(RuntimeError, match="disk full"):
        ph.state_dict()
    assert ph.state_dict()["snapshot_index"] == 2  # raised once; the step it failed stays counted
    ph.close()


def test_save_snapshot_reports_the_failed_write_of_its_step(tmp_path, monkeypatch):
    """save_snapshot() at the step whose periodic snapshot failed returned silently (that step
    counted as snapshotted), the failure left for a later call."""
    import fused_ema.posthoc.snapshots as snapshots

    write = snapshots.write_snapshot

    def second_fails(path, tensors, metadata):
        if path.name == "000000-ema1.safetensors":
            raise OSError("disk full")
        write(path, tensors, metadata)

    monkeypatch.setattr(snapshots, "write_snapshot", second_fails)
    model = net()
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path)
    train(model, 2, lambda t: ph.update(model))
    ph._snapshots._written[-1].wait()
    with pytest.raises(RuntimeError, match="disk full"):
        ph.save_snapshot()
    assert ph.state_dict()["snapshot_index"] == 1
    # a snapshot is all its EMAs' files or none: ema0's, written before ema1's failed, is gone
    # (synthesis would have read it as one EMA's profile at a step the other lacks)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    ph.close()


def test_a_write_failing_during_an_update_is_raised_by_the_next_call_not_by_that_update(
    tmp_path, monkeypatch
):
    """An earlier snapshot's failure that landed while an update ran was raised by that update
    after it had changed the EMAs, and the snapshot it was due to take was never written."""
    import threading

    import fused_ema.posthoc.snapshots as snapshots

    write, release = snapshots.write_snapshot, threading.Event()

    def first_fails(path, tensors, metadata):
        if path.name.startswith("000000-"):
            release.wait()
            raise OSError("disk full")
        write(path, tensors, metadata)

    monkeypatch.setattr(snapshots, "write_snapshot", first_fails)
    model = net()
    ph = PostHocEma(model, (0.1,), snapshot_every=2, snapshot_dir=tmp_path)
    train(model, 3, lambda t: ph.update(model))
    leader, pending = ph.emas[0], list(ph._snapshots._written)
    update = leader._update  # what the set's update() runs on its leading track

    def failure_lands_meanwhile(*args, **kwargs):
        update(*args, **kwargs)
        release.set()
        pending[0].wait()

    monkeypatch.setattr(leader, "_update", failure_lands_meanwhile)
    ph.update(model)  # step 4: its snapshot is taken, the failure waits for the next call
    monkeypatch.setattr(leader, "_update", update)
    assert ph.step == 4
    before = ph.emas[0].state_dict()["weights"]["0.weight"].clone()
    with pytest.raises(RuntimeError, match="disk full"):
        ph.update(model)
    assert ph.step == 4
    assert torch.equal(before, ph.emas[0].state_dict()["weights"]["0.weight"])
    ph.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000001-ema0.safetensors"]


def test_an_update_whose_count_is_read_after_it_refuses_a_bad_folder_before_changing_anything(
    tmp_path,
):
    """With the update count unknown beforehand (a tensor step, the first update after
    load_state_dict) the folder was checked only after the update: refused, it had counted."""
    model = net()
    first = PostHocEma(model, (0.1,), snapshot_every=1, snapshot_dir=tmp_path / "a")
    train(model, 1, lambda t: first.update(model))
    checkpoint = copy.deepcopy(first.state_dict())
    first.close()
    fresh = PostHocEma(model, (0.1,), snapshot_every=1, snapshot_dir=tmp_path / "a")
    with pytest.raises(RuntimeError, match="already holds 1 snapshots"):
        fresh.update(model, step=torch.tensor(1))
    assert fresh.step == 0
    (tmp_path / "b").write_text("a file where the folder was")
    resumed = PostHocEma(model, (0.1,), snapshot_every=1, snapshot_dir=tmp_path / "b")
    resumed.load_state_dict(checkpoint)
    before = resumed.emas[0].state_dict()["weights"]["0.weight"].clone()
    with pytest.raises(FileExistsError):
        resumed.update(model)
    assert resumed.step == 1
    assert torch.equal(before, resumed.emas[0].state_dict()["weights"]["0.weight"])


def test_a_compiled_training_step_updates_every_ema_and_still_writes_snapshots(tmp_path):
    model = net()
    eager_model = copy.deepcopy(model)
    compiled_ema = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path)
    eager_ema = PostHocEma(eager_model, (0.05, 0.1))

    @torch.compile(backend="eager")
    def update(m):
        compiled_ema.update(m)

    def step(t):
        update(model)
        eager_model.load_state_dict(model.state_dict())
        eager_ema.update(eager_model)

    train(model, 4, step)
    compiled_ema.synchronize()
    for a, b in zip(compiled_ema.emas, eager_ema.emas):
        assert a.step == b.step == 4
        for name, value in b.state_dict()["weights"].items():
            assert torch.equal(value, a.state_dict()["weights"][name]), name
    assert len(list(tmp_path.glob("*.safetensors"))) == 4


def test_a_compiled_update_snapshots_and_checks_as_an_eager_one(tmp_path):
    """Compiled, update() skipped what the eager one does first: the next update overwrote the
    EMA before the writer copied it out (a snapshot held a later update's EMA), and a step back
    wrote a snapshot that made the folder unusable for synthesis."""
    from safetensors import safe_open

    model = net()
    ph = PostHocEma(
        model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path, snapshot_dtype=None
    )

    @torch.compile(backend="eager")
    def update(m, step):
        ph.update(m, step=step)

    seen = {}

    def step(t):
        update(model, torch.tensor(t))
        seen[t] = [e.state_dict()["weights"]["0.weight"].clone() for e in ph.emas]

    train(model, 8, step)
    with pytest.raises(ValueError, match="snapshot steps must grow"):
        update(model, torch.tensor(4))
    assert ph.step == 8
    ph.close()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 8
    for path in files:
        with safe_open(str(path), "pt") as f:
            at, k = int(f.metadata()["step"]), int(path.stem.rsplit("ema", 1)[1])
            assert torch.equal(f.get_tensor("0.weight"), seen[at][k]), path.name
    fused_ema.posthoc.synthesize(tmp_path, sigma_rel=0.07)


def test_every_track_follows_a_structure_change_or_refuses_it_whole():
    model = net()
    strict = PostHocEma(model, (0.05, 0.1))
    following = PostHocEma(model, (0.05, 0.1), on_mismatch="resync")
    train(model, 2, lambda t: (strict.update(model), following.update(model)))
    model.append(nn.Linear(3, 2))  # a new head
    with pytest.raises(fused_ema.StructureMismatchError):
        strict.update(model)
    assert [e.step for e in strict.emas] == [2, 2]
    following.update(model)
    for ema in following.emas:
        assert ema.step == 3
        assert torch.equal(ema.state_dict()["weights"]["4.weight"], model[4].weight)


@pytest.mark.parametrize("call", ["update(step=)", "save_snapshot"])
def test_a_resumed_run_still_refuses_a_snapshot_step_that_does_not_grow(tmp_path, call):
    """A resumed PostHocEma forgot the last snapshot's update count: update(step=) going back, or
    save_snapshot() at an update count that has one, wrote a snapshot that made the folder
    unusable for synthesis. It reads that count from the folder now."""
    from fused_ema.posthoc import list_snapshots

    model = net()
    ph = PostHocEma(model, (0.05, 0.1), snapshot_every=4, snapshot_dir=tmp_path)
    train(model, 10 if call == "save_snapshot" else 12, lambda t: ph.update(model, step=t))
    if call == "save_snapshot":
        ph.save_snapshot()  # at update count 10
    ph.load_state_dict(copy.deepcopy(ph.state_dict()))
    before, files = weights_of(ph.emas), sorted(tmp_path.iterdir())
    if call == "save_snapshot":
        ph.save_snapshot()  # none: this update count has one
    else:
        with pytest.raises(ValueError, match="snapshot steps must grow"):
            ph.update(model, step=8)
    ph.close()
    assert sorted(tmp_path.iterdir()) == files and same_weights(before, ph.emas)
    steps = [s.step for s in list_snapshots(tmp_path) if s.ema_index == 0]
    assert steps == ([4, 8, 10] if call == "save_snapshot" else [4, 8, 12])
    assert ph.synthesize(0.07)  # the folder is still usable


def test_a_fresh_run_refuses_a_folder_of_ema_pytorch_checkpoints(tmp_path):
    from test_posthoc_synthesis import ema_pytorch_run

    from fused_ema.posthoc import synthesize

    ema_pytorch_run(tmp_path, steps=6, every=3, sigma_rels=(0.05, 0.28))
    files = sorted(tmp_path.iterdir())
    model = net()
    ours = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path)
    ours.update(model)
    with pytest.raises(RuntimeError, match="holds ema-pytorch PostHocEMA checkpoints"):
        ours.update(model)
    assert ours.step == 1 and sorted(tmp_path.iterdir()) == files
    assert synthesize(tmp_path, sigma_rel=0.1, tracked_sigma_rels=(0.05, 0.28))


def test_a_checkpoint_of_another_snapshot_every_is_refused(tmp_path):
    model = net()
    source = PostHocEma(model, (0.05, 0.1), snapshot_every=5, snapshot_dir=tmp_path / "a")
    train(model, 6, lambda t: source.update(model))
    target = PostHocEma(model, (0.05, 0.1), snapshot_every=3, snapshot_dir=tmp_path / "b")
    before = weights_of(target.emas)
    with pytest.raises(
        CheckpointError, match="snapshot_every 5: this PostHocEma snapshots every 3"
    ):
        target.load_state_dict(source.state_dict())
    assert target.step == 0 and same_weights(before, target.emas)
    source.close()


def test_a_failed_non_blocking_update_leaves_the_snapshots_labelled_by_their_update(
    tmp_path, monkeypatch
):
    """A non_blocking update whose worker fails is undone; PostHocEma's own update count, which
    labels the snapshots, stayed one ahead of it, so every later snapshot was taken one update
    early under a step its values did not have, and one due at the failed update was lost. The
    run equals one that skipped the failed updates, file for file."""
    import threading

    from safetensors import safe_open
    from safetensors.torch import load_file

    import fused_ema._update.plan as plan

    fail, real = {"on": False}, plan.lerp_many_

    def flaky(*args, **kwargs):
        if fail["on"] and threading.current_thread() is not threading.main_thread():
            fail["on"] = False
            raise RuntimeError("worker failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(plan, "lerp_many_", flaky)
    model = net()
    ref = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path / "ref")
    later = PostHocEma(model, (0.05, 0.1), snapshot_every=2, snapshot_dir=tmp_path / "nb")
    failing = (3, 6)  # 6: an update that takes a snapshot (update count 6)

    def step(t):
        fail["on"] = t in failing
        later.update(model, non_blocking=True)
        if t in failing:
            with pytest.raises(RuntimeError, match="worker failed"):
                later.synchronize()
        else:
            ref.update(model)

    train(model, 12, step)
    ref.synchronize()
    later.synchronize()
    assert later.step == ref.step == 10
    names = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "nb").iterdir()) and len(names) == 10
    for name in names:
        a, b = tmp_path / "ref" / name, tmp_path / "nb" / name
        with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
            assert fa.metadata()["step"] == fb.metadata()["step"], name
        x, y = load_file(str(a)), load_file(str(b))
        assert all(torch.equal(x[n], y[n]) for n in x), name
