"""`python -m fused_ema.posthoc`: writes the synthesized EMA atomically as safetensors (with its
sigma_rel, gamma and step), draws the profiles with --plot, reads ema-pytorch folders, and answers
bad input with exit status 2 and one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import posthoc_reference as ref
from fused_ema.posthoc import sigma_rel_to_gamma, synthesize
from fused_ema.posthoc.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("snapshots")
    ref.Run(200, {20: (folder, torch.float16)}).run()
    return folder


def test_writes_the_synthesized_ema(snapshots, tmp_path, capsys):
    out = tmp_path / "ema.safetensors"
    assert main([str(snapshots), "--sigma-rel", "0.07", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    written = load_file(out)
    expected = synthesize(snapshots, sigma_rel=0.07)
    assert set(written) == set(expected)  # safetensors keeps no order
    for name, value in expected.items():
        assert torch.equal(written[name], value), name
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert float(meta["sigma_rel"]) == 0.07 and int(meta["step"]) == 200
    assert float(meta["gamma"]) == sigma_rel_to_gamma(0.07) and float(meta["fit_error"]) < 0.05
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema.safetensors"]  # no temporary left


def test_options(snapshots, tmp_path):
    out = tmp_path / "ema.safetensors"
    gamma = sigma_rel_to_gamma(0.15)
    argv = [str(snapshots), "--gamma", str(gamma), "--step", "100", "--dtype", "float16"]
    assert main([*argv, "--out", str(out)]) == 0
    written = load_file(out)
    expected = synthesize(snapshots, gamma=gamma, step=100, dtype=torch.float16)
    assert written["0.weight"].dtype == torch.float16
    assert all(torch.equal(written[n], expected[n]) for n in expected)
    assert int(written[ref.COUNTER]) == 100


def test_plot_writes_a_png(snapshots, tmp_path, capsys):
    out, plot = tmp_path / "ema.safetensors", tmp_path / "profile.png"
    assert (
        main([str(snapshots), "--sigma-rel", "0.03", "--out", str(out), "--plot", str(plot)]) == 0
    )
    data = plot.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    assert str(plot) in capsys.readouterr().out


def bad(argv, capsys, *match):
    code = main(argv)
    err = capsys.readouterr().err
    assert (
        code == 2 and err.count("\n") == 1 and err.startswith("python -m fused_ema.posthoc: error")
    )
    for m in match:
        assert m in err, err


def test_bad_input_exits_2_with_one_line(snapshots, tmp_path, capsys):
    out = str(tmp_path / "ema.safetensors")
    d = str(snapshots)
    bad([str(tmp_path / "none"), "--sigma-rel", "0.1", "--out", out], capsys, "no snapshot folder")
    bad([d, "--sigma-rel", "-0.1", "--out", out], capsys, "sigma_rel must be in")
    bad([d, "--sigma-rel", "nan", "--out", out], capsys, "sigma_rel must be finite")
    bad([d, "--sigma-rel", "0.1", "--step", "30", "--out", out], capsys, "not a snapshot step")
    bad(
        [d, "--sigma-rel", "0.1", "--out", str(tmp_path / "x" / "e.safetensors")],
        capsys,
        "no folder",
    )
    bad([d, "--sigma-rel", "0.1", "--tracked-sigma-rels", "0.05,0.1", "--out", out], capsys,
        "ema-pytorch folders only")  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    bad([str(empty), "--sigma-rel", "0.1", "--out", out], capsys, "holds no snapshots")
    fifo, link = tmp_path / "out.fifo", tmp_path / "link.safetensors"
    os.mkfifo(fifo)
    link.symlink_to(tmp_path / "elsewhere.safetensors")
    for special in (fifo, link):  # the atomic write's rename would replace them
        bad([d, "--sigma-rel", "0.1", "--out", str(special)], capsys, "not a regular file")
    assert link.is_symlink() and not (tmp_path / "elsewhere.safetensors").exists()
    snapshot = sorted(snapshots.glob("*.safetensors"))[-1]
    before = snapshot.read_bytes()
    bad([d, "--sigma-rel", "0.1", "--out", str(snapshot)], capsys, "is a snapshot of the folder")
    assert snapshot.read_bytes() == before
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "000000-ema0.safetensors").write_bytes(b"\x00" * 20)
    bad([str(damaged), "--sigma-rel", "0.1", "--out", out], capsys, "000000-ema0.safetensors")
    assert not os.path.exists(out)
    for argv in (
        [d, "--out", out],
        [d, "--sigma-rel", "0.1", "--gamma", "3", "--out", out],
        [d, "--sigma-rel", "0.1"],
        [d, "--sigma-rel", "0.1", "--out", out, "--dtype", "int8"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_a_plot_or_out_it_cannot_write_writes_nothing(snapshots, tmp_path, capsys):
    """A --plot into a missing folder or of an unknown format failed only after --out was
    written (exit status 2 with the EMA on disk); an --out naming a folder gave an os.replace
    error about a temporary file."""
    out, d = tmp_path / "ema.safetensors", str(snapshots)
    for plot, match in ((tmp_path / "x" / "p.png", "no folder"), (tmp_path / "p.xyz", "xyz")):
        bad([d, "--sigma-rel", "0.1", "--out", str(out), "--plot", str(plot)], capsys, match)
        assert sorted(os.listdir(tmp_path)) == []
    bad([d, "--sigma-rel", "0.1", "--out", str(tmp_path)], capsys, "--out", "is a folder")
    bad([d, "--sigma-rel", "0.1", "--out", str(out), "--plot", str(tmp_path)], capsys, "--plot")
    assert sorted(os.listdir(tmp_path)) == []


def test_as_a_module(snapshots, tmp_path):
    """The real entry point, in a process of its own: success, then bad input."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "ema.safetensors"
    command = [sys.executable, "-m", "fused_ema.posthoc", str(snapshots), "--out", str(out)]
    done = subprocess.run(
        [*command, "--sigma-rel", "0.07"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 0 and "wrote" in done.stdout
    assert "synthesizing" in done.stderr  # the tqdm bar
    done = subprocess.run([*command, "--sigma-rel", "0.5"], env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "sigma_rel must be in" in done.stderr


def test_an_ema_pytorch_folder(tmp_path, capsys):
    from test_posthoc_synthesis import ema_pytorch_run

    folder = tmp_path / "ema_pytorch"
    folder.mkdir()
    ema_pytorch_run(folder, steps=40)
    out = tmp_path / "ema.safetensors"
    argv = [str(folder), "--sigma-rel", "0.07", "--out", str(out)]
    bad(argv, capsys, "needs the sigma_rels or the gammas")
    # A list that does not fit the folder's EMAs is refused, not taken in part.
    bad([*argv, "--tracked-sigma-rels", "0.05,0.10,0.2"], capsys, "checkpoints of 2 EMAs, but 3")
    bad([*argv, "--tracked-sigma-rels", "0.05"], capsys, "checkpoint of EMA 1, but 1")
    # --out onto one of its files would replace a snapshot.
    target = next(folder.glob("1.*.pt"))
    before = target.read_bytes()
    bad([str(folder), "--sigma-rel", "0.07", "--tracked-sigma-rels", "0.05,0.10", "--out",
         str(target)], capsys, "is a snapshot of the folder")  # fmt: skip
    assert target.read_bytes() == before
    assert main([*argv, "--tracked-sigma-rels", "0.05,0.10"]) == 0
    expected = synthesize(folder, sigma_rel=0.07, tracked_sigma_rels=(0.05, 0.10))
    written = load_file(out)
    assert all(torch.equal(written[n], expected[n]) for n in expected)
