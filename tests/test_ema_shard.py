"""ModelEma(shard=...) on a DDP model with 2 and 4 gloo processes on the CPU: the sharded EMA
equals an unsharded EMA of the same training bit for bit, evaluation gathers it into the model,
DCP checkpoints move between world sizes (4 -> 2 -> 1, sharded <-> unsharded), structure changes
and bad input fail alike on every rank. Each process runs under a 30 s collective timeout and the
whole job under a hard time limit, so nothing hangs the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_ema

dcp = pytest.importorskip("torch.distributed.checkpoint")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = Path(__file__).parent / "distributed" / "shard_worker.py"
sys.path.insert(0, str(WORKER.parent))
import launch  # noqa: E402
from shard_worker import SETTINGS, STEPS, ShardNet  # noqa: E402


def torchrun(scenario: str, out: Path, nproc: int, *extra: str) -> list[dict]:
    return launch.torchrun(WORKER, scenario, out, nproc, *extra)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_ema_equals_unsharded_ema_bit_for_bit(world, tmp_path):
    ranks = torchrun("train", tmp_path, world)
    full_bytes = ranks[0]["full_bytes"]
    for rank, r in enumerate(ranks):
        assert r["step"] == STEPS
        assert r["differs"] == [], f"rank {rank}: {r['differs']}"
        assert r["cpu_differs"] == [], f"rank {rank}, device='cpu': {r['cpu_differs']}"
        assert r["small_buckets_differ"] == [], f"rank {rank}: {r['small_buckets_differ']}"
        assert r["sr_differs"] == [], f"rank {rank}, stochastic rounding: {r['sr_differs']}"
        assert r["collectives_in_update"] == 0
        assert r["swapped_same"] and r["swapped_train_same"]
        assert r["swapped_weights_differ"] == []
        assert r["restored"] and r["restored_after_raise"]
        assert r["module_same"] and r["module_kind"] == "SwappedModelView"
        assert r["copy_to_differs"] == []
        assert r["rank0_only"] == (len(ShardNet().state_dict()) if rank == 0 else 0)
        # one flat float32 buffer: total / world + padding (64-byte alignment of 14 chunks, and
        # the rows a shorter last chunk leaves)
        sharded = full_bytes - r["bytes"]["whole"]
        assert r["bytes"]["span"] <= sharded / world + 14 * 64 + 4 * 60
        assert r["bytes"]["chunks"] <= r["bytes"]["span"]
    assert sum(r["bytes"]["chunks"] for r in ranks) == full_bytes - ranks[0]["bytes"]["whole"]
    shapes = [r["local_shapes"] for r in ranks]
    rows = [s["emb.weight"][0] for s in shapes]
    assert sum(rows) == 5 and rows[0] == -(-5 // world)  # torch.chunk of the rows
    assert [s["pos"] for s in shapes][0] == [1, -(-3 // world), 4]  # its second dimension
    assert shapes[-1]["l2.bias"] == [0]  # one row: the last rank's chunk is empty
    assert "scale" not in shapes[0]  # 0-dim: kept whole


def unsharded_load(checkpoint: Path) -> tuple[fused_ema.ModelEma, dict]:
    ema = fused_ema.ModelEma(ShardNet(), **SETTINGS)
    state = ema.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    ema.load_state_dict(state)
    suffix = checkpoint.name[len("ckpt") :]
    return ema, torch.load(checkpoint.parent / f"full{suffix}.pt", weights_only=True)


def test_dcp_reshards_4_to_2_to_1_and_into_an_unsharded_ema(tmp_path):
    torchrun("dcp_save", tmp_path, 4)
    for r in torchrun("dcp_load", tmp_path, 2, str(tmp_path / "ckpt4")):
        assert r["differs"] == [] and r["sharded"] and r["plain_differs"] == []
        assert r["step"] == r["expected_step"] + 1 == 13
    for r in torchrun("dcp_load", tmp_path, 1, str(tmp_path / "ckpt2")):
        assert r["differs"] == [] and r["sharded"]
    ema, expected = unsharded_load(tmp_path / "ckpt1")
    assert ema.step == expected["step"] == 12
    weights = ema.state_dict()["weights"]
    assert set(weights) == set(expected["weights"])
    for name, value in expected["weights"].items():
        assert torch.equal(weights[name], value), name
    ema4, expected4 = unsharded_load(tmp_path / "ckpt4")  # straight from 4 ranks
    for name, value in expected4["weights"].items():
        assert torch.equal(ema4.state_dict()["weights"][name], value), name


def test_dcp_from_an_unsharded_ema_into_a_sharded_one(tmp_path):
    torch.manual_seed(3)
    model = ShardNet()
    ema = fused_ema.ModelEma(model, **SETTINGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 8):
        model(torch.randint(0, 5, (8,))).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update(model, step=step)
    dcp.save(ema.state_dict(), checkpoint_id=str(tmp_path / "ckptU"), no_dist=True)
    torch.save({"weights": ema.state_dict()["weights"], "step": ema.step}, tmp_path / "fullU.pt")
    for r in torchrun("dcp_load", tmp_path, 2, str(tmp_path / "ckptU")):
        assert r["differs"] == [] and r["sharded"] and r["expected_step"] == 7


@pytest.mark.parametrize(("saved", "loaded"), [(4, 2), (1, 2)])
def test_a_sharded_state_dict_of_another_world_size_fails_clearly_without_dcp(
    saved, loaded, tmp_path
):
    torchrun("dcp_save", tmp_path, saved)
    for r in torchrun("plain_load", tmp_path, loaded, str(saved)):
        for outcome in (r, r["unsharded"]):
            error = outcome["error"]
            assert error is not None and error.startswith("CheckpointError"), outcome
            assert (
                f"sharded over {saved} ranks" in error and "torch.distributed.checkpoint" in error
            )
            assert outcome["unchanged"] and outcome["step"] == 0


def test_a_group_rank_or_state_dict_no_rank_can_use_fails_alike_with_nothing_changed(tmp_path):
    ranks = torchrun("misuse", tmp_path, 2)
    for rank, r in enumerate(ranks):
        assert r["other_group"].startswith("ValueError") and "not part of" in r["other_group"]
        bad = r["bad_rank"]
        assert bad["2"].startswith("ValueError") and "rank=2" in bad["2"], bad
        assert bad["-1"].startswith("ValueError") and "0 to 1" in bad["-1"], bad
        assert bad["'0'"].startswith("TypeError") and bad["True"].startswith("TypeError"), bad
        assert r["full_after"]
        for kind in ("sharded", "unsharded"):
            error = r[kind]["error"]
            assert error is not None and error.startswith("CheckpointError"), (kind, error)
            assert f"rank [{1 - rank}]" in error and "rank that saved it" in error, error
            assert r[kind]["unchanged"] and r[kind]["step"] == 0, (kind, r[kind])
    assert ranks[0]["bad_rank"] == ranks[1]["bad_rank"]


@pytest.mark.parametrize("world", [2, 4])
def test_structure_changes_behave_as_unsharded_on_every_rank(world, tmp_path):
    for r in torchrun("structure", tmp_path, world):
        error = r["error"]
        assert error["sharded"] == error["reference"] != "ok"
        assert "StructureMismatchError" in error["sharded"]
        for name in ("extra.weight", "l1.weight", "l2.weight"):
            assert name in error["sharded"]
        assert error["differs"] == [] and error["names"]
        resync = r["resync"]
        assert resync["sharded"] == resync["reference"] == "ok"
        assert resync["differs"] == [] and resync["names"] and resync["after"] == []


@pytest.mark.parametrize("world", [2, 4])
def test_a_model_not_replicated_identically_fails_on_every_rank(world, tmp_path):
    ranks = torchrun("bad_replica", tmp_path, world)
    errors = [r["error"] for r in ranks]
    assert errors[0] is not None and all(e == errors[0] for e in errors)
    assert "replicated identically" in errors[0] and "holds other values" in errors[0]
    assert "rank 1" in errors[0]
    permuted = [r["permuted"] for r in ranks]  # the same values, in another order, on one rank
    assert permuted[0] is not None and all(e == permuted[0] for e in permuted)
    assert "replicated identically" in permuted[0] and f"rank {world - 1}: l1.weight" in permuted[0]
    for r in ranks:
        assert r["copied_differs"] == []  # a deepcopy keeps working, alike
        assert r["pickled"].startswith("TypeError") and "dcp" not in r["pickled"]
        assert "torch.distributed.checkpoint" in r["pickled"]
        assert r["mesh"].startswith("ValueError") and "1-D DeviceMesh" in r["mesh"]


def test_shard_needs_an_initialised_process_group():
    with pytest.raises(ValueError, match="init_process_group"):
        fused_ema.ModelEma(ShardNet(), shard=True)
    with pytest.raises(TypeError, match="ProcessGroup"):
        fused_ema.ModelEma(ShardNet(), shard="world")


def test_the_shard_benchmark_runs_and_reports_total_over_world(tmp_path):
    from benchmarks import shard

    padding = {(r["model"], r["world"]): r for r in shard.padding_table()}
    assert padding[("vit", 4)]["per_rank_mb"] * 4 >= padding[("vit", 4)]["total_mb"]
    assert all(0 <= r["overhead_pct"] < 1 for r in padding.values())
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "benchmarks.shard", "--worlds", "2", "--model", "resnet50"]
    cmd += ["--rounds", "1", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, cwd=root, env=env, timeout=240, capture_output=True)
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("shard_resnet50_*.json")]
    ranks = record["worlds"]["2"]
    for r in ranks:
        assert r["chunk_bytes"] <= r["buffer_span_bytes"] <= r["unsharded_bytes"] / 2 + 2**16
    assert (
        sum(r["chunk_bytes"] + r["whole_bytes"] / 2 for r in ranks) == ranks[0]["unsharded_bytes"]
    )
