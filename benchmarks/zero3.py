"""EMA of a DeepSpeed ZeRO-3 model at world size 2 (gloo processes on the CPU, DS_ACCELERATOR=cpu):
fused_ema.ModelEma, which averages each rank's partitions, against diffusers' EMAModel as its
training scripts use it under ZeRO-3 (a whole fp32 copy per rank, every step gathering the model
inside deepspeed.zero.GatheredParameters). Per rank: the EMA's bytes, and medians of interleaved
updates after a barrier (wall and this thread's CPU time).

    python -m benchmarks.zero3 [--width 2048] [--depth 6] [--rounds 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from . import report
from .shard import torchrun
from .timing import summary

DECAY = 0.999
WORLD = 2


def _config(width: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": width},
    }


def worker(out: Path, width: int, depth: int, rounds: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist
    from transformers.integrations import HfDeepSpeedConfig

    import fused_ema

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo is all this needs
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    config = _config(width)
    # Kept alive: diffusers asks it whether ZeRO-3 is on, when it is imported and at every step.
    hf_config = HfDeepSpeedConfig(config)  # noqa: F841
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    engine, *_ = deepspeed.initialize(model=model, config=config)
    module = engine.module
    params = list(module.parameters())
    ours = fused_ema.ModelEma(module, decay=DECAY)
    with deepspeed.zero.GatheredParameters(params):  # diffusers' scripts: a whole copy per rank
        theirs = EMAModel(module.parameters(), decay=DECAY, foreach=True)
    steps = {
        "fused_ema.ModelEma": lambda: ours.update(module),
        "diffusers EMAModel": lambda: theirs.step(module.parameters()),
    }
    timings = {name: ([], []) for name in steps}
    for r in range(rounds + 2):  # 2 rounds of warm-up
        for name, step in steps.items():
            dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            step()
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            if r >= 2:
                timings[name][0].append(wall)
                timings[name][1].append(cpu)
    mine = {
        "rank": rank,
        "model_numel": sum(p.ds_numel for p in params),
        "ema_bytes": {
            "fused_ema.ModelEma": sum(
                t.numel() * t.element_size() for t in ours.state_dict()["weights"].values()
            ),
            "diffusers EMAModel": sum(t.numel() * t.element_size() for t in theirs.shadow_params),
        },
        "update_wall": {k: summary(v[0]) for k, v in timings.items()},
        "update_cpu": {k: summary(v[1]) for k, v in timings.items()},
    }
    every = [None] * WORLD
    dist.all_gather_object(every, mine)
    if rank == 0:
        (out / "zero3_ranks.json").write_text(json.dumps(every))
    dist.destroy_process_group()


def run(out: Path, width: int, depth: int, rounds: int) -> list[dict]:
    args = ["--worker", str(out), "--width", str(width), "--depth", str(depth)]
    torchrun(WORLD, "benchmarks.zero3", [*args, "--rounds", str(rounds)], DS_ACCELERATOR="cpu")
    return json.loads((out / "zero3_ranks.json").read_text())


def markdown(record: dict) -> str:
    lines = [
        f"# EMA of a DeepSpeed ZeRO-3 model, world size {WORLD}, gloo on the CPU",
        "",
        f"{record['machine']['cpu']}, torch {record['machine']['torch']}, deepspeed "
        f"{record['deepspeed']}, diffusers {record['diffusers']}; an MLP of {record['depth']} "
        f"Linear({record['width']}, {record['width']}) ({record['model_numel'] / 1e6:.1f}M "
        f"float32 parameters); one torch thread per rank; medians of {record['rounds']} "
        "interleaved rounds, each after a barrier.",
        "",
        "| rank | EMA | EMA MB on this rank | update wall ms | update CPU ms (this thread) |",
        "|---|---|---|---|---|",
    ]
    for r in record["ranks"]:
        for name, size in r["ema_bytes"].items():
            lines.append(
                f"| {r['rank']} | {name} | {size / 2**20:.1f} | "
                f"{r['update_wall'][name]['median_ms']:.2f} | "
                f"{r['update_cpu'][name]['median_ms']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.width, args.depth, args.rounds)
        return
    import importlib.metadata as metadata

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = run(out, args.width, args.depth, args.rounds)
    (out / "zero3_ranks.json").unlink()
    info = report.machine(["cpu"])
    record = {
        "machine": info,
        "deepspeed": metadata.version("deepspeed"),
        "diffusers": metadata.version("diffusers"),
        "width": args.width,
        "depth": args.depth,
        "rounds": args.rounds,
        "model_numel": ranks[0]["model_numel"],
        "ranks": ranks,
    }
    stem = out / f"zero3_{report.slug(info)}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
