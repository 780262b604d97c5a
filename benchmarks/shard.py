"""ModelEma(shard=True) under DDP-style replication: what each rank holds and how long its update
takes, at world sizes 1, 2 and 4 (gloo processes on the CPU, one torch thread each), next to an
unsharded ModelEma of the same model in the same processes; plus, computed from the parameter
shapes alone, the padding the chunk layout costs for real models at larger world sizes.

    python -m benchmarks.shard [--worlds 1,2,4] [--model vit] [--rounds 12] [--out DIR]

Per rank and world size: the EMA bytes it holds (its chunks, the flat buffer they live in, and
the tensors kept whole), and medians of interleaved update() calls of both EMAs, in this thread's
CPU time and in wall time (every rank updates at once, after a barrier, as in training; on a
machine with fewer cores than ranks the wall time measures the sharing, the CPU time the work).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from . import report
from .models import DecoderLM, ResNet50, ViTB16, perturb_, randomize_
from .timing import summary

MODELS = {"vit": ViTB16, "resnet50": ResNet50, "decoder": DecoderLM}
PADDING_WORLDS = (2, 4, 8, 64)


def averaged_shapes(model) -> list[tuple]:
    """Shapes of the tensors a float32 ModelEma averages and shards (dim >= 1, floating)."""
    from fused_ema._model.walk import named_tensors

    return [
        tuple(t.tensor.shape)
        for t in named_tensors(model)
        if t.tensor.is_floating_point() and t.tensor.dim() > 0
    ]


def padding_table() -> list[dict]:
    """Per-rank bytes of the flat buffer against total / world, from the layout alone."""
    from fused_ema._dist.shard import layout

    rows = []
    for name, cls in MODELS.items():
        with torch.device("meta"):
            shapes = averaged_shapes(cls())
        total = sum(torch.Size(s).numel() for s in shapes) * 4
        for world in PADDING_WORLDS:
            _, elements = layout(shapes, world, 4)
            rows.append(
                {
                    "model": name,
                    "world": world,
                    "total_mb": total / 2**20,
                    "per_rank_mb": elements * 4 / 2**20,
                    "overhead_pct": 100 * (elements * 4 / (total / world) - 1),
                }
            )
    return rows


# ---------------------------------------------------------------------- one rank


def worker(out: Path, model_name: str, rounds: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import fused_ema

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = randomize_(MODELS[model_name](), seed=0)  # the same weights on every rank
    sharded = fused_ema.ModelEma(model, decay=0.999, shard=True)
    whole = fused_ema.ModelEma(model, decay=0.999)
    timings: dict = {"sharded": ([], []), "unsharded": ([], [])}
    for r in range(rounds + 2):
        perturb_(model, seed=r)
        order = [("sharded", sharded), ("unsharded", whole)]
        for name, ema in order if r % 2 else order[::-1]:
            dist.barrier()
            cpu, wall = time.thread_time(), time.perf_counter()
            ema.update(model)
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            if r >= 2:  # two warm-up rounds
                timings[name][0].append(cpu)
                timings[name][1].append(wall)
    chunks = kept = 0
    lo, hi = None, 0
    for t in sharded.state_dict()["weights"].values():
        if isinstance(t, DTensor):
            part = t.to_local()
            chunks += part.numel() * part.element_size()
            if part.numel():
                lo = part.data_ptr() if lo is None else min(lo, part.data_ptr())
                hi = max(hi, part.data_ptr() + part.numel() * part.element_size())
        else:
            kept += t.numel() * t.element_size()
    full = sum(t.numel() * t.element_size() for t in whole.state_dict()["weights"].values())
    dist.barrier()
    gather = time.perf_counter()
    with sharded.swapped(model):
        pass
    gather = time.perf_counter() - gather
    mine = {
        "rank": rank,
        "chunk_bytes": chunks,
        "buffer_span_bytes": hi - (lo or 0),
        "whole_bytes": kept,
        "unsharded_bytes": full,
        "update_cpu": {k: summary(v[0]) for k, v in timings.items()},
        "update_wall": {k: summary(v[1]) for k, v in timings.items()},
        "swapped_enter_exit_ms": gather * 1e3,
    }
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        (out / f"shard_world{world}.json").write_text(json.dumps(every))
    dist.destroy_process_group()


# ---------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(world: int, module: str, args: list[str], timeout: int = 1800, **env) -> None:
    """Runs `python -m module --worker ... args` in `world` processes (torch.distributed.run), one
    torch thread each, from the repository root."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        module,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    root = Path(__file__).resolve().parent.parent
    subprocess.run(cmd, check=True, cwd=root, env=env, timeout=timeout)


def run_world(world: int, out: Path, model: str, rounds: int) -> list[dict]:
    args = ["--worker", str(out), "--model", model, "--rounds", str(rounds)]
    torchrun(world, "benchmarks.shard", args)
    return json.loads((out / f"shard_world{world}.json").read_text())


def markdown(record: dict) -> str:
    lines = [
        f"# ModelEma(shard=True): {record['model']}, gloo on the CPU",
        "",
        f"{record['machine']['cpu']}, torch {record['machine']['torch']}, one torch thread per "
        f"rank; medians of {record['rounds']} interleaved rounds. EMA bytes per rank: its chunks "
        "(+ the flat buffer's padding) and the tensors kept whole; `update` CPU: this thread's "
        "CPU time; wall: after a barrier, all ranks at once.",
        "",
        "| world | EMA MB / rank | of which padding | vs unsharded | update CPU ms (sharded / "
        "unsharded) | update wall ms (sharded / unsharded) | swapped() in+out ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, ranks in record["worlds"].items():
        for r in ranks:
            mb = (r["buffer_span_bytes"] + r["whole_bytes"]) / 2**20
            pad = (r["buffer_span_bytes"] - r["chunk_bytes"]) / 2**20
            cpu, wall = r["update_cpu"], r["update_wall"]
            lines.append(
                f"| {world} (rank {r['rank']}) | {mb:.1f} | {pad:.3f} | "
                f"{mb * 2**20 / r['unsharded_bytes']:.3f} | "
                f"{cpu['sharded']['median_ms']:.1f} / {cpu['unsharded']['median_ms']:.1f} | "
                f"{wall['sharded']['median_ms']:.1f} / {wall['unsharded']['median_ms']:.1f} | "
                f"{r['swapped_enter_exit_ms']:.0f} |"
            )
    lines += [
        "",
        "Padding of the chunk layout, from parameter shapes alone (float32 EMA; per rank, the "
        "flat buffer is the sum over tensors of their first rank's chunk, 64-byte aligned):",
        "",
        "| model | world | EMA MB (whole) | MB / rank | over total / world |",
        "|---|---|---|---|---|",
    ]
    for row in record["padding"]:
        lines.append(
            f"| {row['model']} | {row['world']} | {row['total_mb']:.1f} | "
            f"{row['per_rank_mb']:.2f} | {row['overhead_pct']:.2f}% |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--model", default="vit", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.model, args.rounds)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / ".shard_runs"
    scratch.mkdir(exist_ok=True)
    worlds = {}
    for world in (int(w) for w in args.worlds.split(",")):
        print(f"world size {world} ...", flush=True)
        worlds[world] = run_world(world, scratch, args.model, args.rounds)
    info = report.machine(["cpu"])
    info["threads"] = 1
    record = {
        "model": args.model,
        "rounds": args.rounds,
        "machine": info,
        "worlds": worlds,
        "padding": padding_table(),
    }
    stem = out / f"shard_{args.model}_{report.slug(info)}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    text = markdown(record)
    stem.with_suffix(".md").write_text(text)
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()
    print(text)


if __name__ == "__main__":
    main()
