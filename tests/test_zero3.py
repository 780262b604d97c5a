"""ModelEma, PostHocEma and Bema of a DeepSpeed ZeRO-3 model: each rank averages the valid elements
of its own partitions with no collective, equal to a float64 EMA of the gathered parameters (and
bit for bit to unsharded twins); swapped() evaluates the EMA and restores the training weights,
copy_to() writes partitions and fp32 masters, full_state_dict() gathers on the rank asked, and
checkpoints per rank or whole load back. A real 2-process job on the CPU (gloo,
DS_ACCELERATOR=cpu); skipped where deepspeed is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:  # found, not imported: importing costs seconds
    pytest.skip("deepspeed is not installed", allow_module_level=True)
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = Path(__file__).parent / "distributed" / "zero3_worker.py"
sys.path.insert(0, str(WORKER.parent))
import launch  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch.torchrun(WORKER, "train", tmp_path_factory.mktemp("zero3"), 2)


def test_each_rank_averages_its_partition_like_the_gathered_float64_ema(ranks):
    for rank, r in enumerate(ranks):
        assert r["layout_ok"], f"rank {rank}: ds_tensor is not the flat slice expected"
        assert r["step"] == 6 + 100
        worst = max(r["errors"].items(), key=lambda kv: kv[1])
        # (errors measured after 6 updates; the 100 more come after)
        assert worst[1] <= 1e-6, f"rank {rank}: {worst[0]} differs by {worst[1]}"
        assert r["sr_equal"], f"rank {rank}: stochastic rounding differs from the unsharded EMA's"


def test_partitions_padding_and_persistent_parameters(ranks):
    first, last = (r["shapes"] for r in ranks)
    # 91 elements over 2 ranks: 46 and 45 (the last partition's tail is padding, left out)
    assert first["a.weight"] == {"ema": [46], "valid": 46, "persist": False}
    assert last["a.weight"] == {"ema": [45], "valid": 45, "persist": False}
    # persistent parameters are partitioned in ds_tensor too: 5 elements as 3 and 2, and 1
    # element with none of it on rank 1
    assert first["b.bias"] == {"ema": [3], "valid": 3, "persist": True}
    assert last["b.bias"] == {"ema": [2], "valid": 2, "persist": True}
    assert first["c.bias"] == {"ema": [1], "valid": 1, "persist": True}
    assert last["c.bias"] == {"ema": [0], "valid": 0, "persist": True}
    assert first["shift"] == last["shift"] == {"ema": [3]}  # buffers stay whole
    # together the ranks hold each element once: 1/world of an unsharded EMA each
    assert sum(r["ema_numel"] for r in ranks) == ranks[0]["model_numel"]


def test_update_issues_no_collective(ranks):
    for rank, r in enumerate(ranks):
        assert r["counter_saw_probe"], "the collective counters missed a real all_reduce"
        assert r["collectives_in_update"] == 0, f"rank {rank}: update() called a collective"
        assert r["dispatched_in_update"] == 0, f"rank {rank}: update() dispatched a collective"
        # the 100 updates checked ran as the prepared (one-call) update, the steady state
        assert r["prepared_runs"] == 100, r["prepared_runs"]


def test_swapped_evaluates_the_ema_and_restores_the_training_weights(ranks):
    for rank, r in enumerate(ranks):
        fp32, bf16 = r["swapped"]["fp32"], r["swapped"]["bf16"]
        assert fp32["error"] <= 1e-5, f"rank {rank}: {fp32}"
        assert bf16["error"] <= 3e-2, f"rank {rank}: {bf16}"  # a bfloat16 EMA's precision
        for kind in (fp32, bf16):
            assert kind["repeatable"] and kind["restored"], f"rank {rank}: {kind}"


def test_copy_to_writes_partitions_and_fp32_masters_that_the_next_step_starts_from(ranks):
    for rank, r in enumerate(ranks):
        c = r["copied"]
        assert c["partitions"] and c["masters"], f"rank {rank}: {c}"
        assert c["seen"], f"rank {rank}: the next forward did not see the EMA"
        # one Adam step (lr 0.05) from the EMA: the master moved by about lr at most
        assert c["stepped"] and 0 < c["moved"] <= 0.06, f"rank {rank}: {c}"


def test_full_state_dict_gathers_on_the_rank_asked_and_loads_into_an_unsharded_ema(ranks):
    first, second = (r["full"] for r in ranks)
    assert second == {"empty": True}
    assert first["shapes_ok"] and first["loaded"], first
    assert first["error"] <= 1e-6 and first["step"] == 106, first


def test_checkpoints_per_rank_reload_refuse_another_rank_and_take_partitions_of_a_whole_one(ranks):
    for rank, r in enumerate(ranks):
        c = r["checkpoints"]
        assert c["refused_other_rank"], f"rank {rank}: {c}"
        assert c["refused_other_rank_dict"] and c["records_rank"], f"rank {rank}: {c}"
        assert c["reloaded"] and c["whole_taken"], f"rank {rank}: {c}"


def test_warmup_update_every_posthoc_ema_and_bema_average_partitions_like_unsharded_twins(ranks):
    for rank, r in enumerate(ranks):
        assert r["tracks_equal"], f"rank {rank}: a scheduled EMA, PostHocEma or Bema track differs"


def test_a_non_blocking_update_averages_as_a_blocking_one(ranks):
    for rank, r in enumerate(ranks):
        assert r["deferred_equal"], f"rank {rank}: the non_blocking EMA differs"


def test_copy_names_copy_partitions_blocking_non_blocking_and_prepared(ranks):
    for rank, r in enumerate(ranks):
        assert r["copies_equal"] == [True, True], f"rank {rank}: {r['copies_equal']}"
        # 100 updates of an unchanged model and one after its partitions changed in place: each
        # the one prepared call, which copied the partitions as they were then
        assert r["copy_prepared"] == {"runs": 101, "followed": True}, f"rank {rank}"


def test_the_engine_itself_is_unwrapped_to_its_module(ranks):
    assert all(r["unwraps"] for r in ranks)


def test_the_benchmark_against_diffusers_runs_and_reports_both(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import subprocess

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "benchmarks.zero3", "--width", "64", "--depth", "2"]
    subprocess.run(
        [*cmd, "--rounds", "2", "--out", str(tmp_path)],
        check=True,
        cwd=root,
        capture_output=True,
        timeout=600,
    )
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("zero3_*.json")]
    for r in record["ranks"]:
        ours, theirs = r["ema_bytes"]["fused_ema.ModelEma"], r["ema_bytes"]["diffusers EMAModel"]
        assert ours < theirs  # each rank: its partitions against a whole copy
        assert set(r["update_wall"]) == {"fused_ema.ModelEma", "diffusers EMAModel"}


def test_the_trainer_callbacks_save_the_ema_whole_and_resume_each_rank_exactly(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ranks = launch.torchrun(WORKER, "trainer", tmp_path, 2)
    for rank, r in enumerate(ranks):
        assert r == {"partitioned": True, "written_whole": True, "restored": True}, rank


def test_accelerate_bf16_engine_gets_a_float32_ema_of_its_bf16_partitions(tmp_path):
    pytest.importorskip("accelerate")
    ranks = launch.torchrun(WORKER, "accelerate_bf16", tmp_path, 2)
    for rank, r in enumerate(ranks):
        assert r["engine"] == "DeepSpeedEngine", r
        assert r["dtypes"] == ["torch.bfloat16", "torch.float32"], r
        assert r["staged"] is False, f"rank {rank}: the bf16 partitions were copied first"
        assert r["error"] <= 1e-6, f"rank {rank}: {r}"
        # save_state / load_state with WholeCheckpoint(ema) registered: each rank's partitions back
        assert r["checkpointed"] == {"moved": True, "restored": True, "step": True}, rank


def test_an_ema_built_before_deepspeed_initialize_keeps_each_ranks_slice(tmp_path):
    ranks = launch.torchrun(WORKER, "before_init", tmp_path, 2)
    for rank, r in enumerate(ranks):
        # swapped() before the first update: refused, naming the partitioning, nothing changed
        assert r["refused"], f"rank {rank}"
        # updated, resynced, loaded whole, and a PostHocEma: equal to twins built after
        assert r["equal"] == [True] * 4, f"rank {rank}: {r['equal']}"
        assert r["sliced"] and r["collectives"] == 0, f"rank {rank}: {r}"


def test_a_structure_change_is_refused_with_nothing_changed_then_followed_on_resync(ranks):
    for r in ranks:
        assert r["mismatch"] == {"refused": True, "followed": True}
