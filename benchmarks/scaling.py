"""How the cost of an update scales: against the parameter count (tensors of 1M parameters), and
against the tensor count at a fixed total, for fused_ema.lerp_ and torch._foreach_lerp_ measured
interleaved. The fused cost should grow linearly with bytes and stay flat in the tensor count.

    python -m benchmarks.scaling [--device cuda] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

import fused_ema

from . import report
from .timing import copy_bandwidth, interleaved, summary, synchronizer

MILLION = 1_000_000
CPU_SIZES = [1, 4, 16, 64, 256, 512]  # millions of float32 parameters
GPU_SIZES = CPU_SIZES + [1024, 2048]
COUNTS = [1, 16, 256, 4096, 65536]  # tensors sharing FIXED_TOTAL parameters
FIXED_TOTAL = 64 * MILLION


def lists(total: int, count: int, device: str):
    numel = total // count
    g = torch.Generator().manual_seed(count)
    ema = [torch.randn(numel, generator=g).to(device) for _ in range(count)]
    src = [torch.randn(numel, generator=g).to(device) for _ in range(count)]
    return ema, src


def measure(total: int, count: int, device: str, rounds: int, reps: int) -> dict:
    ema_fused, src = lists(total, count, device)
    ema_foreach = [e.clone() for e in ema_fused]
    steps = {
        "fused_ema.lerp_": lambda: fused_ema.lerp_(ema_fused, src, 1e-3),
        "torch._foreach_lerp_": lambda: torch._foreach_lerp_(ema_foreach, src, 1e-3),
    }
    samples = interleaved(steps, rounds, reps, synchronizer(device))
    row = {"params": total, "tensors": count, "bytes": 12 * total}
    for name, times in samples.items():
        stats = summary(times)
        stats["gbps"] = row["bytes"] / (stats["median_ms"] / 1e3) / 1e9
        stats["us_per_tensor"] = stats["median_ms"] * 1e3 / count
        row[name] = stats
    return row


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("fused_ema.lerp_", "-o"), ("torch._foreach_lerp_", "--s")):
        sizes = record["by_params"]
        left.loglog(
            [r["params"] for r in sizes], [r[name]["median_ms"] for r in sizes], style, label=name
        )
        counts = record["by_tensors"]
        right.loglog(
            [r["tensors"] for r in counts],
            [r[name]["median_ms"] for r in counts],
            style,
            label=name,
        )
    bw = record["copy_bandwidth_gbps"]
    floor = [12 * r["params"] / (bw * 1e9) * 1e3 for r in record["by_params"]]
    left.loglog(
        [r["params"] for r in record["by_params"]],
        floor,
        ":",
        color="gray",
        label=f"12 B/param at copy bandwidth ({bw:.0f} GB/s)",
    )
    left.set(
        xlabel="parameters (float32, 1M per tensor)",
        ylabel="ms per update",
        title="cost against size",
    )
    right.set(
        xlabel=f"tensors sharing {FIXED_TOTAL // MILLION}M parameters",
        ylabel="ms per update",
        title="cost against tensor count",
    )
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = record["machine"]
    fig.suptitle(
        f"{m.get('gpu') or m['cpu']} ({m['threads']} threads), torch {m['torch']}, {m['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--max-params",
        type=int,
        default=None,
        help="largest size, in millions (default 512 on CPU, 2048 on GPU)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    sizes = GPU_SIZES if args.device.startswith("cuda") else CPU_SIZES
    if args.max_params:
        sizes = [s for s in sizes if s <= args.max_params]
    record = {
        "machine": report.machine([args.device]),
        "device": args.device,
        "copy_bandwidth_gbps": copy_bandwidth(args.device),
        "by_params": [],
        "by_tensors": [],
    }
    with tqdm(total=len(sizes) + len(COUNTS), desc="scaling", leave=False) as bar:
        for size in sizes:
            total = size * MILLION
            record["by_params"].append(
                measure(total, total // MILLION, args.device, args.rounds, args.reps)
            )
            bar.update(1)
        for count in COUNTS:
            record["by_tensors"].append(
                measure(FIXED_TOTAL, count, args.device, args.rounds, args.reps)
            )
            bar.update(1)
    print(
        f"{'params':>8} {'tensors':>8} {'fused ms':>9} {'foreach ms':>11} {'speed-up':>9} "
        f"{'fused us/tensor':>16}"
    )
    for row in record["by_params"] + record["by_tensors"]:
        fused, foreach = row["fused_ema.lerp_"], row["torch._foreach_lerp_"]
        print(
            f"{row['params'] / MILLION:7.0f}M {row['tensors']:8d} {fused['median_ms']:9.2f} "
            f"{foreach['median_ms']:11.2f} {foreach['median_ms'] / fused['median_ms']:8.2f}x "
            f"{fused['us_per_tensor']:16.3f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"scaling_{report.slug(record['machine'])}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    chart(record, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")
    return record


if __name__ == "__main__":
    main()
