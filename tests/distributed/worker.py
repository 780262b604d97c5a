"""One rank of a distributed ModelEma test, started by tests/test_distributed.py through torchrun:

    python -m torch.distributed.run --nproc-per-node=N worker.py SCENARIO OUT_DIR BACKEND [CKPT]

Each rank writes OUT_DIR/SCENARIO_rank{R}.json with what it measured; the test asserts on those.
A reference ModelEma of an unsharded copy of the model runs next to the distributed one in every
rank, trained on the same batches, so the two must agree.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fused_ema

STEPS = 12
SETTINGS = dict(decay=0.9, warmup=(2.0, 0.75), update_after_step=1)


class Net(nn.Module):
    """Dimensions 5, 7 and 1 do not divide by 2: uneven shards, and an empty one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 10)
        self.l1 = nn.Linear(10, 7)
        self.norm = nn.LayerNorm(7)
        self.l2 = nn.Linear(7, 1)

    def forward(self, tokens):
        return self.l2(self.norm(torch.relu(self.l1(self.emb(tokens)))))


def batch(step: int, device, rank_salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step + 7919 * rank_salt)
    return torch.randint(0, 5, (16,), generator=g).to(device)


def train_step(model, optimizer, tokens):
    loss = model(tokens).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def setup(backend: str):
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, device


def sharded_pair(device, seed=0):
    """An FSDP2-sharded model and an unsharded copy with the same weights."""
    torch.manual_seed(seed)
    model = Net().to(device)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, reference


def max_error(ema: fused_ema.ModelEma, reference: fused_ema.ModelEma) -> float:
    full = ema.full_state_dict(rank=None)
    ref = reference.state_dict()["weights"]
    return max(float((full[n].double() - ref[n].double().cpu()).abs().max()) for n in ref)


def fsdp(out: Path, rank: int, device) -> dict:
    model, reference = sharded_pair(device)
    ema = fused_ema.ModelEma(model, **SETTINGS)
    ref_ema = fused_ema.ModelEma(reference, **SETTINGS)
    # Stochastically rounded bf16 EMAs of the sharded model and of an unsharded mirror holding
    # exactly its values: the random bits follow each element's index in the full tensor.
    mirror = copy.deepcopy(reference)
    sr_ema = fused_ema.ModelEma(model, dtype=torch.bfloat16, **SETTINGS)
    sr_mirror = fused_ema.ModelEma(mirror, dtype=torch.bfloat16, **SETTINGS)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    collectives = 0
    for step in range(1, STEPS + 1):
        tokens = batch(step, device)  # the same batch on every rank
        train_step(model, opt, tokens)
        train_step(reference, ref_opt, tokens)
        with CommDebugMode() as comm:
            ema.update(model)
            sr_ema.update(model)
        collectives += comm.get_total_counts()
        ref_ema.update(reference)
        with torch.no_grad():
            for (_, m), p in zip(mirror.named_parameters(), model.parameters()):
                m.copy_(p.full_tensor())
        sr_mirror.update(mirror)
    weights = ema.state_dict()["weights"]
    params = dict(model.named_parameters())
    placements_match = all(
        isinstance(weights[n], DTensor)
        and weights[n].placements == p.placements
        and weights[n].device_mesh == p.device_mesh
        and weights[n].to_local().shape == p.to_local().shape
        for n, p in params.items()
    )
    local_shapes = {n: list(weights[n].to_local().shape) for n in params}
    # Evaluation with the EMA in the sharded model, against the reference's EMA in its model.
    tokens = batch(99, device)
    with torch.no_grad(), ema.swapped(model), ref_ema.swapped(reference):
        swapped_err = float((model(tokens) - reference(tokens)).abs().max())
    restored = all(
        float((p.full_tensor() - r).abs().max()) == 0.0
        for (_, p), r in zip(model.named_parameters(), reference.parameters())
    )
    try:
        with torch.no_grad():
            module_err = float((ema.module(tokens) - ref_ema.module(tokens)).abs().max())
    except Exception as err:  # recorded: the test decides
        module_err = f"{type(err).__name__}: {err}"
    # The raw op takes DTensors sharded alike, each rank updating its shards.
    params = [p.detach() for p in model.parameters()]
    ours = [p.clone() for p in params]
    theirs = [p.clone() for p in params]
    fused_ema.lerp_(ours, [p * 2 for p in params], 0.25)
    torch._foreach_lerp_(theirs, [p * 2 for p in params], 0.25)
    raw_error = max(float((a - b).full_tensor().abs().max()) for a, b in zip(ours, theirs))
    return {
        "raw_dtensor_error": raw_error,
        "max_error": max_error(ema, ref_ema),
        "stochastic_error": max_error(sr_ema, sr_mirror),
        "collectives_in_update": collectives,
        "placements_match": placements_match,
        "local_shapes": local_shapes,
        "swapped_error": swapped_err,
        "restored_after_swap": restored,
        "module_error": module_err,
        "step": ema.step,
    }


def dcp_save(out: Path, rank: int, device) -> dict:
    model, _ = sharded_pair(device)
    ema = fused_ema.ModelEma(model, **SETTINGS)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(1, STEPS + 1):
        train_step(model, opt, batch(step, device))
        ema.update(model)
    dcp.save(ema.state_dict(), checkpoint_id=str(out / "ckpt"))
    full = ema.full_state_dict(rank=0)  # every rank takes part in the gather
    if rank == 0:
        torch.save({"weights": full, "step": ema.step}, out / "full.pt")
    return {"saved": True, "step": ema.step}


def dcp_load(out: Path, rank: int, device, checkpoint: str) -> dict:
    model, _ = sharded_pair(device, seed=5)  # other weights: the load must replace them
    ema = fused_ema.ModelEma(model, **SETTINGS)
    state = ema.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    ema.load_state_dict(state)
    expected = torch.load(Path(checkpoint).parent / "full.pt", weights_only=True)
    full = ema.full_state_dict(rank=None)
    error = max(float((full[n] - v).abs().max()) for n, v in expected["weights"].items())
    still_sharded = all(
        isinstance(t, DTensor)
        for t in ema.state_dict()["weights"].values()
        if t.is_floating_point()
    )
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch(1, device))
    ema.update(model)  # and it keeps working after the load
    return {
        "max_error": error,
        "step": ema.step,
        "expected_step": expected["step"],
        "still_sharded": still_sharded,
    }


def ddp(out: Path, rank: int, device) -> dict:
    torch.manual_seed(0)
    model = Net().to(device)
    wrapped = nn.parallel.DistributedDataParallel(model)
    from_wrapper = fused_ema.ModelEma(wrapped, **SETTINGS)
    from_module = fused_ema.ModelEma(wrapped.module, **SETTINGS)
    # an EMA on one rank only, kept on the CPU: update() never communicates, so nothing waits
    rank0_only = fused_ema.ModelEma(wrapped, device="cpu", **SETTINGS) if rank == 0 else None
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    for step in range(1, STEPS + 1):
        train_step(wrapped, opt, batch(step, device, rank_salt=rank))  # different data per rank
        from_wrapper.update(wrapped)
        from_module.update(wrapped.module)
        if rank0_only is not None:
            rank0_only.update(wrapped)
    a = from_wrapper.state_dict()["weights"]
    b = from_module.state_dict()["weights"]
    same = list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    checksum = sum(float(t.double().sum()) for t in a.values() if t.is_floating_point())
    if rank0_only is not None:
        c = rank0_only.state_dict()["weights"]
        same = same and all(torch.equal(c[n], a[n].cpu()) for n in a)
    return {"names": list(a), "same_ema": same, "checksum": checksum}


def posthoc_ddp(out: Path, rank: int, device) -> dict:
    """PostHocEma of a DDP model: every rank tracks the same EMAs, rank 0 alone writes snapshots."""
    from fused_ema.posthoc import PostHocEma

    torch.manual_seed(0)
    model = Net().to(device)
    wrapped = nn.parallel.DistributedDataParallel(model)
    folder = out / "snapshots"
    ema = PostHocEma(wrapped, (0.05, 0.1), snapshot_every=2, snapshot_dir=folder)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    for step in range(1, STEPS + 1):
        train_step(wrapped, opt, batch(step, device, rank_salt=rank))
        ema.update(wrapped)
    ema.close()
    weights = [e.state_dict()["weights"] for e in ema.emas]
    checksum = sum(float(t.double().sum()) for w in weights for t in w.values())
    return {
        "checksum": checksum,
        "steps": ema.step,
        "snapshot_index": ema.state_dict()["snapshot_index"],
    }


def bema_ddp(out: Path, rank: int, device) -> dict:
    """Bema of a DDP model, one full copy and one sharded (each rank its chunk): every rank holds
    the same corrected weights, and the sharded one gathers to the full one's."""
    from fused_ema import Bema

    torch.manual_seed(0)
    model = Net().to(device)
    wrapped = nn.parallel.DistributedDataParallel(model)
    full = Bema(wrapped, update_freq=2, update_after=1)
    sharded = Bema(wrapped, update_freq=2, update_after=1, shard=True)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    for step in range(1, STEPS + 1):
        train_step(wrapped, opt, batch(step, device, rank_salt=rank))
        full.update(wrapped)
        sharded.update(wrapped)
    mine = full.corrected.full_state_dict(rank=None)
    gathered = sharded.corrected.full_state_dict(rank=None)
    return {
        "checksum": sum(float(t.double().sum()) for t in mine.values()),
        "sharded_equal": all(torch.equal(mine[k], gathered[k]) for k in mine),
        "steps": full.step,
    }


def main() -> None:
    scenario, out, backend = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    rank, device = setup(backend)
    try:
        if scenario == "dcp_load":
            result = dcp_load(out, rank, device, sys.argv[4])
        else:
            scenarios = {
                "fsdp": fsdp,
                "dcp_save": dcp_save,
                "ddp": ddp,
                "posthoc_ddp": posthoc_ddp,
                "bema_ddp": bema_ddp,
            }
            result = scenarios[scenario](out, rank, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    (out / f"{scenario}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
