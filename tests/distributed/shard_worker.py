"""One rank of a ModelEma(shard=...) test, started by tests/test_ema_shard.py through torchrun:

    python -m torch.distributed.run --nproc-per-node=N shard_worker.py SCENARIO OUT_DIR [ARG]

A DDP model is trained on different data per rank; next to the sharded EMA, every rank keeps an
unsharded ModelEma of the same model as the reference. Each rank writes its results (errors
included, as text) to OUT_DIR/SCENARIO_rank{R}.json for the test to assert on. Every collective
runs under a 30 s timeout.
"""

from __future__ import annotations

import copy
import json
import pickle
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fused_ema
from fused_ema._dist import shard

# This folder, also where PYTHONSAFEPATH keeps a script's own folder off sys.path (cuda-build.sh).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker import Net  # noqa: E402

STEPS = 100
SETTINGS = dict(decay=0.95, warmup=(2.0, 0.75), update_after_step=2, update_every=3)
COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "reduce_scatter_tensor",
    "barrier",
)


class ShardNet(Net):
    """Rows 5, 7 and 1 split unevenly (empty chunks at 2 and 4 ranks), a [1, 3, 4] tensor split
    along its second dimension, a 0-dim parameter kept whole, a channels_last convolution weight,
    BatchNorm buffers (the integer one copied, not averaged)."""

    def __init__(self):
        super().__init__()  # worker.Net's layers, in its order
        self.bn = nn.BatchNorm1d(1)
        self.pos = nn.Parameter(torch.randn(1, 3, 4))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.conv = nn.Conv2d(2, 6, 3).to(memory_format=torch.channels_last)

    def forward(self, tokens):
        h = self.bn(self.l2(self.norm(torch.relu(self.l1(self.emb(tokens))))))
        conv = self.conv.weight.square().mean() + self.conv.bias.mean()
        return h * self.scale + self.pos.mean() + conv


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step + 7919 * rank)
    return torch.randint(0, 5, (16,), generator=g)


def train_step(model, optimizer, tokens) -> None:
    model(tokens).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def ddp_model(seed: int = 0):
    torch.manual_seed(seed)
    return nn.parallel.DistributedDataParallel(ShardNet())


def count_collectives():
    """Counts calls of torch.distributed collectives from here on: returns a read function."""
    calls = [0]
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args, _fn=fn, **kwargs):
            calls[0] += 1
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)
    return lambda: calls[0]


def bits_equal(a: dict, b: dict) -> list:
    """Names whose tensors differ in any bit (or are missing)."""
    bad = [n for n in b if n not in a]
    bad += [n for n in a if n not in b or not torch.equal(a[n].cpu(), b[n].cpu())]
    return bad


def local_bytes(ema) -> dict:
    """This rank's EMA memory: the address span its chunks cover (one buffer: its size, give or
    take the padding after the last chunk), their own bytes, and the tensors kept whole."""
    lo, hi, own, whole = None, 0, 0, 0
    for t in ema.state_dict()["weights"].values():
        if not isinstance(t, DTensor):
            whole += t.numel() * t.element_size()
            continue
        part = t.to_local()
        if part.numel():
            start = part.data_ptr()
            lo = start if lo is None else min(lo, start)
            hi = max(hi, start + part.numel() * part.element_size())
            own += part.numel() * part.element_size()
    return {"span": hi - (lo or 0), "chunks": own, "whole": whole}


def train(out: Path, rank: int, world: int) -> dict:
    model = ddp_model()
    sharded = fused_ema.ModelEma(model, shard=True, **SETTINGS)
    reference = fused_ema.ModelEma(model, **SETTINGS)
    on_cpu = fused_ema.ModelEma(model, shard=dist.group.WORLD, device="cpu", **SETTINGS)
    mesh = init_device_mesh("cpu", (world,))
    sr = fused_ema.ModelEma(model, shard=mesh, dtype=torch.bfloat16, **SETTINGS)
    sr_ref = fused_ema.ModelEma(model, dtype=torch.bfloat16, **SETTINGS)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    collectives = count_collectives()
    in_update = 0
    for step in range(1, STEPS + 1):
        train_step(model, opt, batch(step, rank))  # different data per rank: DDP averages
        # BatchNorm statistics differ between ranks after a forward (DDP broadcasts rank 0's at
        # the next one): make them rank 0's now, so that every rank's reference is the same EMA
        for b in model.module.buffers():
            dist.broadcast(b, 0)
        before = collectives()
        for ema in (sharded, on_cpu, sr):
            ema.update(model, step=step)
        in_update += collectives() - before
        for ema in (reference, sr_ref):
            ema.update(model, step=step)
    ref = {k: v.clone() for k, v in reference.state_dict()["weights"].items()}
    result = {
        "step": sharded.step,
        "collectives_in_update": in_update,
        "differs": bits_equal(sharded.full_state_dict(rank=None), ref),
        "cpu_differs": bits_equal(on_cpu.full_state_dict(rank=None), ref),
        "sr_differs": bits_equal(sr.full_state_dict(rank=None), sr_ref.state_dict()["weights"]),
        "rank0_only": len(sharded.full_state_dict(rank=0)),
        "small_buckets_differ": small_buckets(sharded, ref),
        "bytes": local_bytes(sharded),
        "full_bytes": sum(t.numel() * t.element_size() for t in ref.values()),
        "local_shapes": {
            n: list(t.to_local().shape)
            for n, t in sharded.state_dict()["weights"].items()
            if isinstance(t, DTensor)
        },
    }
    # Evaluation: the EMA gathered into the model, against the unsharded EMA's weights.
    tokens = batch(999, 0)
    module = model.module
    training = {k: v.clone() for k, v in module.state_dict().items()}
    module.eval()
    with torch.no_grad(), sharded.swapped(model):
        out_sharded = module(tokens)
        inside = {k: v.clone() for k, v in module.state_dict().items()}
    with torch.no_grad(), reference.swapped(model):
        out_reference = module(tokens)
    result["swapped_same"] = torch.equal(out_sharded, out_reference)
    result["swapped_weights_differ"] = [n for n, v in ref.items() if not torch.equal(inside[n], v)]
    result["restored"] = not bits_equal(module.state_dict(), training)
    with torch.no_grad():
        result["module_same"] = torch.equal(sharded.module(tokens), reference.module(tokens))
    result["module_kind"] = type(sharded.module).__name__
    target = ShardNet()
    sharded.copy_to(target)
    result["copy_to_differs"] = [
        n for n, v in ref.items() if not torch.equal(target.state_dict()[n], v)
    ]
    # swapped() restores the model when the block raises
    try:
        with sharded.swapped(model):
            raise KeyError("inside")
    except KeyError:
        pass
    result["restored_after_raise"] = not bits_equal(module.state_dict(), training)
    # in training mode too (last: the unsharded EMA's exchange keeps the BatchNorm statistics
    # the block's forward writes, the gathered one does not)
    module.train()
    with torch.no_grad(), sharded.swapped(model):
        out_sharded = module(tokens)
    with torch.no_grad(), reference.swapped(model):
        out_reference = module(tokens)
    result["swapped_train_same"] = torch.equal(out_sharded, out_reference)
    return result


def small_buckets(ema, ref: dict) -> list:
    """full_state_dict() gathered in buckets of 5 to 100 bytes a rank: most tensors are split
    across buckets, some buckets hold the tail of one tensor and the head of the next."""
    differ = []
    for size in (5, 24, 100):
        with mock.patch.object(shard, "BUCKET_BYTES", size * dist.get_world_size()):
            differ += bits_equal(ema.full_state_dict(rank=None), ref)
    return differ


def dcp_save(out: Path, rank: int, world: int) -> dict:
    model = ddp_model()
    ema = fused_ema.ModelEma(model, shard=True, **SETTINGS)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(1, 13):
        train_step(model, opt, batch(step, rank))
        ema.update(model, step=step)
    dcp.save(ema.state_dict(), checkpoint_id=str(out / f"ckpt{world}"))
    torch.save(ema.state_dict(), out / f"plain{world}_rank{rank}.pt")  # not the way to reshard
    full = ema.full_state_dict(rank=0)
    if rank == 0:
        torch.save({"weights": full, "step": ema.step}, out / f"full{world}.pt")
    return {"step": ema.step}


def dcp_load(out: Path, rank: int, world: int, checkpoint: str) -> dict:
    """Loads `checkpoint` (another world size, or unsharded) into a sharded EMA, saves it again
    at this world size, and keeps updating."""
    model = ddp_model(seed=5)  # other weights: the load must replace them
    ema = fused_ema.ModelEma(model, shard=True, **SETTINGS)
    state = ema.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    ema.load_state_dict(state)
    expected = torch.load(Path(checkpoint).parent / f"full{Path(checkpoint).name[4:]}.pt")
    full = ema.full_state_dict(rank=None)
    dcp.save(ema.state_dict(), checkpoint_id=str(out / f"ckpt{world}"))
    again = ema.full_state_dict(rank=0)
    if rank == 0:
        torch.save({"weights": again, "step": ema.step}, out / f"full{world}.pt")
    sharded = all(
        isinstance(t, DTensor) for t in ema.state_dict()["weights"].values() if t.dim() > 0
    )
    # plain full weights (a model state dict) load too: each rank keeps its chunk of them
    plain = fused_ema.ModelEma(ddp_model(seed=9), shard=True, **SETTINGS)
    plain.load_state_dict(expected["weights"], strict=True)
    plain_differs = bits_equal(plain.full_state_dict(rank=None), expected["weights"])
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch(1, rank))
    ema.update(model)
    return {
        "differs": bits_equal(full, expected["weights"]),
        "plain_differs": plain_differs,
        "step": ema.step,
        "expected_step": expected["step"],
        "sharded": sharded,
    }


def plain_load(out: Path, rank: int, world: int, saved_world: str) -> dict:
    """torch.load of a sharded state dict saved at another world size, into a sharded EMA and
    into an unsharded one: a clear error."""
    saved_rank = min(rank, int(saved_world) - 1)  # a smaller job: its last rank's file
    result = {}
    for kind, shard_with in (("sharded", True), ("unsharded", False)):
        state = torch.load(out / f"plain{saved_world}_rank{saved_rank}.pt", weights_only=False)
        result[kind] = _load_outcome(
            fused_ema.ModelEma(ddp_model(), shard=shard_with, **SETTINGS), state
        )
    return {**result["sharded"], "unsharded": result["unsharded"]}


def _load_outcome(ema, state) -> dict:
    """ema.load_state_dict(state): its error (as text) and whether the EMA stayed as it was."""
    before = {
        k: v.to_local().clone() if isinstance(v, DTensor) else v.clone()
        for k, v in ema.state_dict()["weights"].items()
    }
    try:
        ema.load_state_dict(state)
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    after = {
        k: v.to_local() if isinstance(v, DTensor) else v
        for k, v in ema.state_dict()["weights"].items()
    }
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"error": error, "unchanged": unchanged, "step": ema.step}


def misuse(out: Path, rank: int, world: int) -> dict:
    """Arguments no rank can use: a group without this rank, a rank= naming no process,
    another rank's torch.save'd state dict. Each fails alike on every rank, with nothing
    changed and no hang."""
    result = {}
    model = ddp_model().module
    groups = [dist.new_group(ranks=[r]) for r in range(world)]
    try:
        fused_ema.ModelEma(model, shard=groups[(rank + 1) % world], **SETTINGS)
        result["other_group"] = None
    except Exception as err:
        result["other_group"] = f"{type(err).__name__}: {err}"
    ema = fused_ema.ModelEma(model, shard=True, **SETTINGS)
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))
        ema.update(model, step=step)
    result["bad_rank"] = {}
    for bad in (world, -1, "0", True):
        try:
            result["bad_rank"][repr(bad)] = f"returned {len(ema.full_state_dict(rank=bad))}"
        except Exception as err:
            result["bad_rank"][repr(bad)] = f"{type(err).__name__}: {err}"
    result["full_after"] = len(ema.full_state_dict(rank=0)) == len(ema.names()) or rank != 0
    torch.save(ema.state_dict(), out / f"misuse_rank{rank}.pt")
    dist.barrier()
    other = (rank + 1) % world
    for kind, shard_with in (("sharded", True), ("unsharded", False)):
        state = torch.load(out / f"misuse_rank{other}.pt", weights_only=False)
        result[kind] = _load_outcome(fused_ema.ModelEma(model, shard=shard_with, **SETTINGS), state)
    return result


class Grown(ShardNet):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(3, 9)


def structure(out: Path, rank: int, world: int) -> dict:
    """Structure changes under on_mismatch, with the unsharded EMA doing the same next to it."""
    model = ddp_model().module  # plain replicas: the structure changes under DDP's feet
    result = {}
    for mode in ("error", "resync"):
        sharded = fused_ema.ModelEma(model, shard=True, on_mismatch=mode, **SETTINGS)
        reference = fused_ema.ModelEma(model, on_mismatch=mode, **SETTINGS)
        sharded.update(model, step=1)
        reference.update(model, step=1)
        torch.manual_seed(7)  # the same new tensors on every rank
        changed = _changed(model)
        outcome = []
        for ema in (sharded, reference):
            try:
                ema.update(changed, step=4)
                outcome.append("ok")
            except Exception as err:
                outcome.append(f"{type(err).__name__}: {err}")
        result[mode] = {
            "sharded": outcome[0],
            "reference": outcome[1],
            "differs": bits_equal(
                sharded.full_state_dict(rank=None), reference.state_dict()["weights"]
            ),
            "names": sharded.names() == reference.names(),
        }
        if mode == "resync":
            for step in (7, 10):
                with torch.no_grad():
                    for p in changed.parameters():
                        p.add_(0.01 * step)
                sharded.update(changed, step=step)
                reference.update(changed, step=step)
            result[mode]["after"] = bits_equal(
                sharded.full_state_dict(rank=None), reference.state_dict()["weights"]
            )
    return result


def _changed(model: ShardNet) -> ShardNet:
    """The model with a module added, a parameter replaced and one reshaped."""
    grown = Grown()
    grown.load_state_dict(model.state_dict(), strict=False)
    grown.l1.weight = nn.Parameter(grown.l1.weight.detach() + 1.0)  # replaced
    grown.l2 = nn.Linear(7, 2)  # reshaped
    return grown


def bad_replica(out: Path, rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # every rank its own weights: not replicated
    model = ShardNet()
    try:
        fused_ema.ModelEma(model, shard=True, **SETTINGS)
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    # the same values on every rank, but the last rank's l1 rows in reverse order
    model = ddp_model().module
    if rank == world - 1:
        with torch.no_grad():
            model.l1.weight.copy_(model.l1.weight.flip(0))
    try:
        fused_ema.ModelEma(model, shard=True, **SETTINGS)
        permuted = None
    except Exception as err:
        permuted = f"{type(err).__name__}: {err}"
    # a copy of a sharded EMA works on (the process group is shared); a pickle is refused
    model = ddp_model().module
    ema = fused_ema.ModelEma(model, shard=True, **SETTINGS)
    ema.update(model, step=1)
    twin = copy.deepcopy(ema)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    ema.update(model, step=4)
    twin.update(model, step=4)
    copied_differs = bits_equal(twin.full_state_dict(rank=None), ema.full_state_dict(rank=None))
    try:
        pickle.dumps(ema)
        pickled = None
    except Exception as err:
        pickled = f"{type(err).__name__}: {err}"
    try:
        fused_ema.ModelEma(nn.Linear(2, 2), shard=init_device_mesh("cpu", (1, world)))
        mesh_2d = None
    except Exception as err:
        mesh_2d = f"{type(err).__name__}: {err}"
    return {
        "error": error,
        "permuted": permuted,
        "copied_differs": copied_differs,
        "pickled": pickled,
        "mesh": mesh_2d,
    }


SCENARIOS = {
    "train": train,
    "dcp_save": dcp_save,
    "dcp_load": dcp_load,
    "plain_load": plain_load,
    "structure": structure,
    "bad_replica": bad_replica,
    "misuse": misuse,
}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = SCENARIOS[scenario](out, rank, world, *sys.argv[3:])
    except Exception:
        result = {"crashed": traceback.format_exc()}
    (out / f"{scenario}_rank{rank}.json").write_text(json.dumps(result))
    # Every rank leaves together: one that tears its gloo pairs down while a peer still sends
    # makes that peer abort.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
