"""Post-hoc EMA synthesis against an independent float64 reference (tests/posthoc_reference.py): a
simulated run tracks power EMAs at sigma_rel 0.05 and 0.10 and writes snapshots; the EMAs of other
widths synthesized from them must match the same EMAs tracked directly, more closely the denser the
snapshots. Also: sigma_rel <-> gamma, the snapshot format's crash safety and its errors, and
ema-pytorch's PostHocEMA folders against ema-pytorch's own synthesis."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import posthoc_reference as ref
from benchmarks import peers as peer_access
from fused_ema import posthoc
from fused_ema.posthoc import (
    GAMMA_MIN,
    SIGMA_REL_MAX,
    SnapshotError,
    gamma_to_sigma_rel,
    list_snapshots,
    next_index,
    save_snapshot,
    sigma_rel_to_gamma,
    snapshot_metadata,
    snapshot_path,
    solve_coefficients,
    synthesize,
    write_snapshot,
)
from peers import peer

ROOT = Path(__file__).resolve().parents[1]
STEPS = 1000
SPARSE, DENSE = 50, 10  # updates between snapshots


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One simulated run: its snapshots every 50 and every 10 updates in float32, and (a second
    pass of the same seed) every 10 in float16; the directly tracked EMAs at the end and at 500."""
    base = tmp_path_factory.mktemp("posthoc")
    dirs = {SPARSE: base / "sparse", DENSE: base / "dense", "half": base / "dense16"}
    for folder in dirs.values():
        folder.mkdir()
    result = ref.Run(
        STEPS, {SPARSE: (dirs[SPARSE], torch.float32), DENSE: (dirs[DENSE], torch.float32)}, (500,)
    ).run()
    ref.Run(STEPS, {DENSE: (dirs["half"], torch.float16)}).run()
    result.dirs = dirs
    return result


# ---------------------------------------------------------------------------- sigma_rel <-> gamma


def test_the_papers_pairs():
    # EDM2 sec. 3: sigma_rel 0.05 and 0.10 are gamma 16.97 and 6.94.
    assert round(sigma_rel_to_gamma(0.05), 2) == 16.97
    assert round(sigma_rel_to_gamma(0.10), 2) == 6.94
    for s in (0.01, 0.05, 0.1, 0.2, 0.3):
        assert sigma_rel_to_gamma(s) == pytest.approx(ref.gamma_of(s), rel=1e-12)


@settings(max_examples=400, deadline=None)
@given(st.floats(min_value=1e-300, max_value=SIGMA_REL_MAX))
def test_sigma_rel_round_trips(s):
    gamma = sigma_rel_to_gamma(s)
    assert gamma >= GAMMA_MIN
    assert gamma_to_sigma_rel(gamma) == pytest.approx(s, rel=1e-12, abs=0)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.floats(-0.35, 10.0), st.floats(10.0, 1e12)))
def test_gamma_round_trips(gamma):
    # Near GAMMA_MIN sigma_rel is flat in gamma (its maximum): no float64 round trip is exact there.
    back = sigma_rel_to_gamma(gamma_to_sigma_rel(gamma))
    assert back == pytest.approx(gamma, rel=1e-12, abs=1e-12)


def test_the_valid_ranges():
    assert GAMMA_MIN == pytest.approx((math.sqrt(5) - 3) / 2)
    assert SIGMA_REL_MAX == pytest.approx(ref.sigma_rel(GAMMA_MIN), rel=1e-15)
    assert sigma_rel_to_gamma(SIGMA_REL_MAX) == GAMMA_MIN
    for bad in (0.0, -0.05, SIGMA_REL_MAX * (1 + 1e-12), 0.5, math.nan, math.inf, 5e-324):
        with pytest.raises(ValueError, match="sigma_rel"):
            sigma_rel_to_gamma(bad)
    for bad in (GAMMA_MIN - 1e-9, -0.5, -1.0, -3.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="gamma"):
            gamma_to_sigma_rel(bad)
    with pytest.raises(TypeError):
        sigma_rel_to_gamma("0.05")
    assert posthoc.power_beta(6.94, 1) == 0.0
    assert posthoc.power_beta(6.94, 10) == pytest.approx(ref.beta(6.94, 10))
    with pytest.raises(ValueError, match="t must be"):
        posthoc.power_beta(6.94, 0)


def test_the_narrowest_widths_have_finite_products_and_fits(tmp_path):
    """sigma_rel near 0 (gamma near the float maximum): the closed form's product and sum of
    gamma + 1 overflowed, giving nan fit errors and then a failed LAPACK call."""
    from fractions import Fraction

    t = float(torch.randint(2, 1000, ()).item())
    for a, b in [(1e300, 1e300), (GAMMA_MIN, 1.7e308), (1.7e308, 6.94), (1e308, 1.7e308)]:
        exact = Fraction(a + 1) * Fraction(b + 1) / (Fraction(a) + Fraction(b) + 1) / Fraction(t)
        got = posthoc.profile_inner_products(t, a, t, b).item()
        assert got == pytest.approx(float(exact), rel=1e-14)
        halves = (t / 2, a, t, b) if b >= a else (t, a, t / 2, b)  # the wider profile longer
        assert posthoc.profile_inner_products(*halves).item() == 0.0  # (1/2) ** 1e300
    write(tmp_path, 0, 0, 10)
    write(tmp_path, 0, 1, 10, gamma=16.97)
    write(tmp_path, 1, 0, 20)
    write(tmp_path, 1, 1, 20, gamma=16.97)
    for kwargs in (dict(sigma_rel=1e-300), dict(sigma_rel=1e-308), dict(gamma=1.7e308)):
        plan = solve_coefficients(tmp_path, **kwargs)
        assert all(math.isfinite(c) for c in plan.coefficients)
        assert sum(plan.coefficients) == pytest.approx(1.0, abs=1e-12)
        assert plan.fit_error == pytest.approx(1.0)  # a spike at the step: nothing fits it
        assert all(bool(v.isfinite().all()) for v in synthesize(tmp_path, **kwargs).values())


# ---------------------------------------------------------------------------- synthesis


def test_coefficients_match_quadrature(run):
    plan = solve_coefficients(run.dirs[SPARSE], sigma_rel=0.07)
    steps = [s.step for s in plan.snapshots]
    gammas = [s.gamma for s in plan.snapshots]
    expected = ref.coefficients(steps, gammas, STEPS, ref.gamma_of(0.07))
    torch.testing.assert_close(
        torch.tensor(plan.coefficients, dtype=torch.float64),
        torch.tensor(expected),
        rtol=1e-7,
        atol=1e-9,
    )
    assert sum(plan.coefficients) == pytest.approx(1.0, abs=1e-12)


def test_synthesis_matches_the_ema_tracked_directly(run):
    """The synthesized EMA is the directly tracked one to within the profile fit, whose error
    falls as snapshots get denser (printed: pytest -s)."""
    print(f"\nsynthesized vs tracked EMA after {STEPS} updates, tracked sigma_rels {ref.TRACKED}:")
    print("sigma_rel  every  rel. error  max abs error  profile fit error")
    for s in ref.TARGETS:
        truth = run.truth[(s, STEPS)]
        errors = {}
        for every in (SPARSE, DENSE):
            got = synthesize(run.dirs[every], sigma_rel=s)
            fit = solve_coefficients(run.dirs[every], sigma_rel=s).fit_error
            errors[every] = ref.relative_error(got, truth, run.models[STEPS])
            worst = max(float((got[n] - truth[n]).abs().max()) for n in ref.SHAPES)
            print(f"{s:9}  {every:5}  {errors[every]:10.2e}  {worst:13.2e}  {fit:17.2e}")
        assert errors[DENSE] < errors[SPARSE] / 4, errors
        assert errors[DENSE] < (0.01 if ref.TRACKED[0] <= s <= ref.TRACKED[1] else 0.05), errors


def test_at_an_earlier_snapshot_step(run):
    got = synthesize(run.dirs[DENSE], sigma_rel=0.07, step=500)
    truth = run.truth[(0.07, 500)]
    assert ref.relative_error(got, truth, run.models[500]) < 0.01
    # not averaged: from the latest snapshot used, in the EMA's dtypes
    assert got[ref.COUNTER].dtype == torch.int64 and int(got[ref.COUNTER]) == 500
    torch.testing.assert_close(got["bn.running_var"], truth["bn.running_var"], rtol=1e-7, atol=0)
    assert got["0.weight"].dtype == torch.float64  # the EMA's own dtype, not the snapshot's


def test_dtype_and_order(run):
    got = synthesize(run.dirs[SPARSE], gamma=sigma_rel_to_gamma(0.07), dtype=torch.bfloat16)
    assert list(got) == [*ref.SHAPES, ref.COUNTER]
    assert {n: t.dtype for n, t in got.items()} == {
        **dict.fromkeys(ref.SHAPES, torch.bfloat16),
        ref.COUNTER: torch.int64,
    }
    with pytest.raises(TypeError, match="floating-point"):
        synthesize(run.dirs[SPARSE], sigma_rel=0.07, dtype=torch.int32)


def test_float16_snapshots_cost_their_rounding_only(run):
    s = 0.07
    plan = solve_coefficients(run.dirs["half"], sigma_rel=s)
    half = synthesize(run.dirs["half"], sigma_rel=s)
    full = synthesize(run.dirs[DENSE], sigma_rel=s)
    largest = max(float(run.truth[(s, STEPS)][n].abs().max()) for n in ref.SHAPES)
    bound = sum(abs(c) for c in plan.coefficients) * 2.0**-11 * 1.2 * largest
    for name in ref.SHAPES:
        assert float((half[name] - full[name]).abs().max()) <= bound, name


def test_reads_one_file_at_a_time(run, monkeypatch):
    """The sum streams: never two snapshot files open at once, each opened a bounded number of
    times (its header checked, then its tensors summed)."""
    import safetensors

    real, state = safetensors.safe_open, {"open": 0, "most": 0, "opens": 0}

    class Counted:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            state["open"] += 1
            state["opens"] += 1
            state["most"] = max(state["most"], state["open"])
            return self.handle.__enter__()

        def __exit__(self, *exc):
            state["open"] -= 1
            return self.handle.__exit__(*exc)

    files = len(list_snapshots(run.dirs[DENSE]))
    monkeypatch.setattr(safetensors, "safe_open", Counted)
    synthesize(run.dirs[DENSE], sigma_rel=0.07)
    assert state["most"] == 1
    assert state["opens"] == 3 * files  # listed, checked, summed


def test_profiles_for_the_plot(run):
    plan = solve_coefficients(run.dirs[DENSE], sigma_rel=0.15)
    tau = torch.linspace(0, STEPS, 20001, dtype=torch.float64)
    target, rebuilt = plan.profiles(tau)
    width = float(tau[1] - tau[0])
    assert float(target.sum() * width) == pytest.approx(1.0, abs=2e-3)
    assert float(rebuilt.sum() * width) == pytest.approx(1.0, abs=2e-3)
    l2 = math.sqrt(float(((target - rebuilt) ** 2).sum() / (target**2).sum()))
    assert l2 == pytest.approx(plan.fit_error, rel=0.05, abs=1e-4)


# ---------------------------------------------------------------------------- errors


def small_state(value=1.0, shape=(3,)):
    return {"w": torch.full(shape, value), "n": torch.tensor(5)}


def write(folder, index, k, step, gamma=6.94, state=None):
    return save_snapshot(folder, state or small_state(), index=index, ema_index=k, step=step,
                         gamma=gamma, snapshot_dtype=None)  # fmt: skip


def test_target_errors(tmp_path):
    write(tmp_path, 0, 0, 10)
    write(tmp_path, 0, 1, 10, gamma=16.97)
    cases = [
        (dict(), ValueError, "exactly one of sigma_rel and gamma .got neither"),
        (dict(sigma_rel=0.1, gamma=6.9), ValueError, "got both"),
        (dict(sigma_rel=-0.1), ValueError, "sigma_rel must be in"),
        (dict(sigma_rel=math.nan), ValueError, "sigma_rel must be finite"),
        (dict(sigma_rel=0.4), ValueError, "sigma_rel must be in"),
        (dict(gamma=-0.9), ValueError, "gamma must be >="),
        (dict(sigma_rel=0.1, step=11), ValueError, "step 11 is not a snapshot step.*nearest: 10"),
        (dict(sigma_rel=0.1, step=5), ValueError, "step 5 is not a snapshot step"),
        (dict(sigma_rel=0.1, step=10.0), TypeError, "step must be an int"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            synthesize(tmp_path, **kwargs)


def test_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no snapshot folder"):
        synthesize(tmp_path / "missing", sigma_rel=0.1)
    (tmp_path / "notes.txt").write_text("not a snapshot")
    with pytest.raises(SnapshotError, match="holds no snapshots"):
        synthesize(tmp_path, sigma_rel=0.1)
    assert list_snapshots(tmp_path) == [] and next_index(tmp_path) == 0
    assert next_index(tmp_path / "missing") == 0


def test_snapshots_that_disagree(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder in (a, b, c):
        folder.mkdir()
        write(folder, 0, 0, 10)
    write(a, 1, 0, 20, state={"v": torch.ones(3), "n": torch.tensor(5)})
    write(b, 1, 0, 20, state=small_state(shape=(4,)))
    write(c, 1, 0, 10)  # a resumed run that went back in time
    for folder, match in ((a, "hold different tensors.*v, w"), (b, "names or shapes differ: w")):
        with pytest.raises(SnapshotError, match=match) as info:
            synthesize(folder, sigma_rel=0.1)
        assert "000001-ema0.safetensors" in str(info.value)
    with pytest.raises(SnapshotError, match="000001-ema0.* follows .*000000-ema0.*abandoned"):
        synthesize(c, sigma_rel=0.1)


def test_a_damaged_snapshot_is_named(tmp_path):
    write(tmp_path, 0, 0, 10)
    good = write(tmp_path, 1, 0, 20)
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 2])  # truncated
    for call in (lambda: list_snapshots(tmp_path), lambda: synthesize(tmp_path, sigma_rel=0.1)):
        with pytest.raises(SnapshotError, match=r"000001-ema0\.safetensors: not a readable"):
            call()
    good.write_bytes(b"")
    with pytest.raises(SnapshotError, match=r"000001-ema0\.safetensors"):
        list_snapshots(tmp_path)
    save_file({"w": torch.ones(3)}, str(good))  # a foreign file under a snapshot's name
    with pytest.raises(SnapshotError, match=r"000001-ema0\.safetensors: not a fused_ema post-hoc"):
        list_snapshots(tmp_path)
    meta = snapshot_metadata(index=1, ema_index=0, step=20, gamma=6.94, names=["w"],
                             dtypes={"w": torch.float32})  # fmt: skip
    save_file({"w": torch.ones(3)}, str(tmp_path / "000002-ema0.safetensors"), metadata=meta)
    good.unlink()
    with pytest.raises(SnapshotError, match="000002-ema0.*says snapshot 1 of EMA 0"):
        list_snapshots(tmp_path)


def test_a_snapshot_storing_a_tensor_of_another_kind_than_its_dtype_is_named(tmp_path):
    """Only floating-point tensors are stored in the snapshot dtype. A file storing a float under
    an integer EMA dtype (or an integer under a float one) was cast (truncated to integers) or
    averaged silently; write_snapshot wrote such a file."""
    write(tmp_path, 0, 0, 10)
    path = snapshot_path(tmp_path, 1, 0)
    for ema_dtype, stored in ((torch.int64, torch.randn(3)), (torch.float32, torch.arange(3))):
        meta = snapshot_metadata(index=1, ema_index=0, step=20, gamma=6.94, names=["w", "n"],
                                 dtypes={"w": ema_dtype, "n": torch.int64})  # fmt: skip
        tensors = {"w": stored, "n": torch.tensor(5)}
        with pytest.raises(SnapshotError, match=r"000001-ema0\.safetensors: stored .*: w$"):
            write_snapshot(path, tensors, meta)
        assert not path.exists()
        save_file(tensors, str(path), metadata=meta)
        with pytest.raises(SnapshotError, match=r"000001-ema0\.safetensors: stored .*: w$"):
            synthesize(tmp_path, sigma_rel=0.1)
        path.unlink()


# ---------------------------------------------------------------------------- writing


def test_write_snapshot_with_the_writers_metadata(tmp_path):
    """PostHocEma's call: write_snapshot(path, tensors in the snapshot dtype, metadata of the EMA's
    own dtypes); the reader sees what was written."""
    state = {"0.weight": torch.randn(4, 3), "bn.num_batches_tracked": torch.tensor(7)}
    meta = snapshot_metadata(
        index=3,
        ema_index=1,
        step=40,
        gamma=6.94,
        sigma_rel=gamma_to_sigma_rel(6.94),
        names=list(state),
        dtypes={n: str(t.dtype).removeprefix("torch.") for n, t in state.items()},
    )
    path = snapshot_path(tmp_path, 3, 1)
    write_snapshot(path, posthoc.snapshot_tensors(state, torch.float16), meta)
    assert path.name == "000003-ema1.safetensors"
    [info] = list_snapshots(tmp_path)
    assert (info.index, info.ema_index, info.step, info.gamma) == (3, 1, 40, 6.94)
    assert info.sigma_rel == gamma_to_sigma_rel(6.94) and info.path == path
    assert next_index(tmp_path) == 4
    with safe_open(str(path), "pt") as f:
        stored = f.metadata()
        assert f.get_tensor("0.weight").dtype == torch.float16
        assert f.get_tensor("bn.num_batches_tracked").dtype == torch.int64
    assert stored["format"] == "fused_ema.posthoc/1"
    assert json.loads(stored["names"]) == list(state)
    assert json.loads(stored["dtypes"]) == {
        "0.weight": "float32",
        "bn.num_batches_tracked": "int64",
    }
    with pytest.raises(SnapshotError, match="not the names its metadata lists"):
        write_snapshot(path, {"other": torch.ones(1)}, meta)
    with pytest.raises(SnapshotError, match="says snapshot 3 of EMA 1"):
        write_snapshot(snapshot_path(tmp_path, 4, 1), state, meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("fails", ["save_file", "fsync", "replace"])
def test_a_failed_write_leaves_no_snapshot(tmp_path, monkeypatch, fails):
    from safetensors import torch as st_torch

    old = write(tmp_path, 0, 0, 10, state=small_state(1.0))
    before = old.read_bytes()

    def broken(*args, **kwargs):
        if fails == "save_file":  # half a file, then the error
            Path(args[1]).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
        raise OSError(f"simulated failure in {fails}")

    target = {
        "save_file": (st_torch, "save_file"),
        "fsync": (os, "fsync"),
        "replace": (os, "replace"),
    }
    monkeypatch.setattr(*target[fails], broken)
    with pytest.raises(OSError, match="simulated"):
        write(tmp_path, 1, 0, 20)
    with pytest.raises(OSError, match="simulated"):  # over an existing snapshot
        write(tmp_path, 0, 0, 10, state=small_state(2.0))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]  # no temporary file left
    assert old.read_bytes() == before
    assert [s.index for s in list_snapshots(tmp_path)] == [0]


def test_a_writer_killed_mid_write_leaves_no_snapshot(tmp_path):
    """SIGKILL between the temporary file's bytes and its rename: only the temporary file stays;
    readers ignore it, the next writer removes it."""
    child = textwrap.dedent(
        f"""
        import os, signal
        import torch
        from safetensors import torch as st_torch
        from fused_ema.posthoc import save_snapshot

        real = st_torch.save_file
        def save_then_die(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            with open(filename, "r+b") as f:
                f.truncate(os.path.getsize(filename) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        st_torch.save_file = save_then_die
        save_snapshot({str(tmp_path)!r}, {{"w": torch.ones(1000)}}, index=0, ema_index=0,
                      step=1, gamma=6.94)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=env, capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    [left] = list(tmp_path.iterdir())
    assert left.name.startswith(".000000-ema0.safetensors.tmp-")
    assert list_snapshots(tmp_path) == [] and next_index(tmp_path) == 0
    with pytest.raises(SnapshotError, match="holds no snapshots"):
        synthesize(tmp_path, sigma_rel=0.1)
    assert posthoc.clean_temporary_files(tmp_path) == [left]
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- ema-pytorch


def ema_pytorch_run(folder, steps=120, every=10, sigma_rels=ref.TRACKED, seed=0):
    """ema-pytorch's PostHocEMA on a small model trained on fresh random data (its EMAs updated
    every step), checkpoints every `every` updates; returns it."""
    ema_pytorch = peer(peer_access.load_ema_pytorch)
    from ema_helpers import small_mlp, train_step

    torch.manual_seed(seed)
    model = small_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    generator = torch.Generator().manual_seed(seed + 1)
    theirs = ema_pytorch.PostHocEMA(
        model,
        sigma_rels=sigma_rels,
        update_every=1,
        checkpoint_every_num_steps=every,
        checkpoint_folder=str(folder),
    )
    for _ in range(steps):
        train_step(model, optimizer, generator)
        theirs.update()
    return theirs


def test_ema_pytorch_folders_synthesize_as_ema_pytorch_does(tmp_path):
    """Our synthesis of ema-pytorch's checkpoints is its own synthesize_ema_model up to one
    documented difference: EDM2 scales the coefficients to sum to 1, ema-pytorch does not (its sum
    is 0.9976-1.0003 here, as far off as its results). Otherwise they agree to float32 sums."""
    theirs = ema_pytorch_run(tmp_path)
    from ema_pytorch.post_hoc_ema import solve_weights

    for s in (0.07, 0.15, 0.03):
        expected = theirs.synthesize_ema_model(sigma_rel=s).ema_model.state_dict()
        ours = synthesize(tmp_path, sigma_rel=s, tracked_sigma_rels=ref.TRACKED)
        plan = solve_coefficients(tmp_path, sigma_rel=s, tracked_sigma_rels=ref.TRACKED)
        gammas = torch.tensor([i.gamma for i in plan.snapshots])  # float32, as ema-pytorch has it
        t = torch.tensor([i.step for i in plan.snapshots])
        weights = solve_weights(
            t, gammas, torch.tensor([120]), torch.tensor([sigma_rel_to_gamma(s)])
        )
        total = float(weights.sum())
        torch.testing.assert_close(
            torch.tensor(plan.coefficients, dtype=torch.float64),
            weights[:, 0].double() / total,
            rtol=1e-6,
            atol=1e-7,
        )
        assert abs(total - 1) < 1e-2, total
        compared = 0
        for name, value in expected.items():
            if value.is_floating_point():
                torch.testing.assert_close(ours[name] * total, value, rtol=2e-6, atol=1e-6)
                compared += 1
        assert compared == 8 and set(ours) == set(expected)
        assert ours["0.weight"].dtype == torch.float32


def test_ema_pytorch_as_a_snapshot_list_and_its_errors(tmp_path):
    ema_pytorch_run(tmp_path, steps=40)
    listed = posthoc.list_ema_pytorch_snapshots(tmp_path, sigma_rels=ref.TRACKED)
    assert [(i.index, i.ema_index, i.step) for i in listed[:3]] == [
        (0, 0, 10),
        (0, 1, 10),
        (1, 0, 20),
    ]
    assert {i.source for i in listed} == {"ema-pytorch"}
    by_gamma = synthesize(
        tmp_path, sigma_rel=0.07, tracked_gammas=[ref.gamma_of(s) for s in ref.TRACKED]
    )
    as_list = synthesize(listed, sigma_rel=0.07)
    for name, value in as_list.items():
        torch.testing.assert_close(by_gamma[name], value, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="sigma_rels or the gammas .* its files do not record"):
        synthesize(tmp_path, sigma_rel=0.07)
    with pytest.raises(SnapshotError, match=r"1\.10\.pt: a checkpoint of EMA 1, but 1 "):
        synthesize(tmp_path, sigma_rel=0.07, tracked_sigma_rels=[0.05])
    (tmp_path / "0.50.pt").write_bytes(b"not a torch file")
    with pytest.raises(SnapshotError, match=r"0\.50\.pt: not a readable ema-pytorch checkpoint"):
        synthesize(tmp_path, sigma_rel=0.07, tracked_sigma_rels=ref.TRACKED, step=50)
    write(tmp_path, 0, 0, 10)
    with pytest.raises(SnapshotError, match="both fused_ema snapshots and ema-pytorch"):
        synthesize(tmp_path, sigma_rel=0.07, tracked_sigma_rels=ref.TRACKED)


def test_ema_pytorch_time_is_edm2_time_plus_one():
    """What migrate.py documents: with update_every=1, ema-pytorch's EMA after k updates is EDM2's
    power EMA at t = k + 1 of the history with its first entry twice."""
    ema_pytorch = peer(peer_access.load_ema_pytorch)
    gamma = ref.gamma_of(0.1)
    model = torch.nn.Linear(3, 2).double()
    theirs = ema_pytorch.KarrasEMA(model, gamma=gamma, update_every=1)
    history = []
    for _ in range(30):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        history.append(model.weight.detach().clone())
        theirs.update()
    ema = None
    for t, theta in enumerate([history[0], *history], start=1):
        b = ref.beta(gamma, t)
        ema = theta.clone() if ema is None else b * ema + (1 - b) * theta
    torch.testing.assert_close(theirs.ema_model.weight, ema, rtol=1e-12, atol=1e-12)
