"""ModelEma on PyTorch's own distributed engine: FSDP2 (DTensor) shards averaged where they lie with
no collective, DCP checkpoints resharded across world sizes, DDP bound to the unwrapped names.

Every run is a real multi-process job (torchrun): 2 CPU processes with gloo here; on GPUs with
NCCL, one process per GPU. Each has a process-group timeout and a hard time limit, so nothing can
hang the suite. The ranks compare against an unsharded reference EMA trained on the same batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fused_ema

dcp = pytest.importorskip("torch.distributed.checkpoint")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = Path(__file__).parent / "distributed" / "worker.py"
sys.path.insert(0, str(WORKER.parent))
import launch  # noqa: E402

from worker import SETTINGS, STEPS, Net  # noqa: E402

BACKENDS = [
    pytest.param(("gloo", 2), id="gloo-2cpu"),
    pytest.param(
        ("nccl", max(torch.cuda.device_count(), 1)),
        id="nccl",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
    ),
]


def torchrun(scenario: str, out: Path, backend: str, nproc: int, *extra: str) -> list[dict]:
    return launch.torchrun(WORKER, scenario, out, nproc, backend, *extra)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_sharded_ema_equals_unsharded_ema(backend, tmp_path):
    name, nproc = backend
    ranks = torchrun("fsdp", tmp_path, name, nproc)
    for rank, r in enumerate(ranks):
        assert r["step"] == STEPS
        assert r["max_error"] <= 1e-6, f"rank {rank}: sharded EMA differs by {r['max_error']}"
        # stochastic rounding keyed by the full-tensor index: sharded == unsharded, bit for bit
        assert r["stochastic_error"] == 0.0, r["stochastic_error"]
        assert r["collectives_in_update"] == 0, "update() communicated"
        assert r["placements_match"], "the EMA is not sharded like the model"
        assert r["swapped_error"] <= 1e-6 and r["restored_after_swap"]
        assert r["module_error"] == pytest.approx(0.0, abs=1e-6), r["module_error"]
        assert r["raw_dtensor_error"] == 0.0  # fused_ema.lerp_ on DTensors: shard by shard
    if name == "gloo":
        # uneven shards: 5, 7 and 1 rows over 2 ranks, rank 1's share of l2 is empty
        shapes = [r["local_shapes"] for r in ranks]
        assert shapes[0]["l1.weight"] == [4, 10] and shapes[1]["l1.weight"] == [3, 10]
        assert shapes[0]["emb.weight"] == [3, 10] and shapes[1]["emb.weight"] == [2, 10]
        assert shapes[1]["l2.weight"] == [0, 7]


def load_single_process(checkpoint: Path) -> tuple[fused_ema.ModelEma, dict]:
    ema = fused_ema.ModelEma(Net(), **SETTINGS)
    state = ema.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    ema.load_state_dict(state)
    return ema, torch.load(checkpoint.parent / "full.pt", weights_only=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_checkpoint_reshards_from_2_ranks_to_1_and_2(backend, tmp_path):
    name, nproc = backend
    torchrun("dcp_save", tmp_path, name, nproc)
    checkpoint = tmp_path / "ckpt"
    # 2 ranks -> 1 process, plain tensors
    ema, expected = load_single_process(checkpoint)
    assert ema.step == expected["step"] == STEPS
    weights = ema.state_dict()["weights"]
    for key, value in expected["weights"].items():
        assert torch.equal(weights[key], value), key
    assert ema.schedule["warmup"] == SETTINGS["warmup"]
    # 2 ranks -> 2 ranks, DTensors in place
    for r in torchrun("dcp_load", tmp_path, name, nproc, str(checkpoint)):
        assert r["max_error"] == 0.0 and r["still_sharded"]
        assert r["step"] == r["expected_step"] + 1  # loaded, then updated once more


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_checkpoint_from_1_process_loads_into_2_ranks(backend, tmp_path):
    name, nproc = backend
    torch.manual_seed(3)
    model = Net()
    ema = fused_ema.ModelEma(model, **SETTINGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        model(torch.randint(0, 5, (8,))).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)
    dcp.save(ema.state_dict(), checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    torch.save({"weights": ema.state_dict()["weights"], "step": ema.step}, tmp_path / "full.pt")
    for r in torchrun("dcp_load", tmp_path, name, nproc, str(tmp_path / "ckpt")):
        assert r["max_error"] == 0.0 and r["still_sharded"] and r["expected_step"] == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_wrapper_and_module_give_the_same_ema(backend, tmp_path):
    name, nproc = backend
    ranks = torchrun("ddp", tmp_path, name, nproc)
    for r in ranks:
        assert r["same_ema"]
        assert r["names"] == [n for n, _ in Net().named_parameters()]  # no "module." prefix
    assert len({r["checksum"] for r in ranks}) == 1, "the EMA differs between ranks"


@pytest.mark.parametrize("backend", BACKENDS)
def test_posthoc_ema_under_ddp_tracks_the_same_emas_and_rank_0_writes_the_snapshots(
    backend, tmp_path
):
    name, nproc = backend
    ranks = torchrun("posthoc_ddp", tmp_path, name, nproc)
    assert len({r["checksum"] for r in ranks}) == 1, "the EMAs differ between ranks"
    assert {r["snapshot_index"] for r in ranks} == {STEPS // 2}
    files = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert files == [f"{i:06d}-ema{k}.safetensors" for i in range(STEPS // 2) for k in range(2)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bema_under_ddp_is_the_same_on_every_rank_full_or_sharded(backend, tmp_path):
    name, nproc = backend
    ranks = torchrun("bema_ddp", tmp_path, name, nproc)
    assert len({r["checksum"] for r in ranks}) == 1, "the corrected weights differ between ranks"
    assert all(r["sharded_equal"] and r["steps"] == STEPS for r in ranks)
