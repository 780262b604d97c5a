"""Post-hoc EMA on the CPU or a GPU: K = 1, 2, 4, 8 EMAs of one model updated by
fused_ema.lerp_many_ (one read of the model), by K fused_ema.lerp_ calls, by
fused_ema.PostHocEma.update and by ema-pytorch's PostHocEMA (K KarrasEMA, a Python loop over
tensors each), interleaved, medians; then the cost of PostHocEma's snapshots on a training step
(snapshot_every=100, written by its background thread), training blocks with and without them
interleaved.

    python -m benchmarks.posthoc [--device cpu|cuda] [--ks 1,2,4,8] [--rounds 9]
                                 [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import fused_ema
from fused_ema.posthoc import PostHocEma, sigma_rel_to_gamma

from . import report
from .peers import load_ema_pytorch
from .timing import interleaved, summary, synchronizer

# Two shapes of a model: few large tensors (bandwidth-bound: K separate lerp_ calls move 12K
# bytes a parameter in float32, lerp_many_ 4 + 8K, so 1.33x at K = 4), and many small ones
# (bound by the per-tensor work, which lerp_many_ does once for all K).
SHAPES = {
    "large": [4 * 2**20] * 4,  # 4 tensors of 4 Mi float32: 64 MiB per EMA
    "small": [256] * 20_000,  # 20,000 tensors of 256 elements
}
TARGETS = {("large", 4): 1.2, ("small", 4): 2.0}  # lerp_many_ over K lerp_ calls, K = 4
PEER_TARGET = 5.0  # PostHocEma.update over ema-pytorch's PostHocEMA.update


def ceiling(k: int) -> float:
    """The most lerp_many_ can gain over K lerp_ calls by reading each source once: of the 2K
    tensors K calls read per source (the source K times, each EMA once), it reads K + 1. Bytes
    bound it lower where the data dominates (float32: 12K / (4 + 8K), 1.33x at K = 4)."""
    return 2 * k / (k + 1)


class Params(nn.Module):
    """A model that is its tensors, for the peers that take a module."""

    def __init__(self, numels: list[int]):
        super().__init__()
        self.p = nn.ParameterList(nn.Parameter(torch.randn(n)) for n in numels)


def sigma_rels(k: int) -> list[float]:
    return [0.05 + 0.1 * i / max(1, k - 1) for i in range(k)]


def scaled(shape: str, scale: float) -> list[int]:
    """The shape's tensor sizes, the large ones' elements or the small ones' count scaled."""
    numels = SHAPES[shape]
    if shape == "large":
        return [max(1, int(n * scale)) for n in numels]
    return numels[: max(1, int(len(numels) * scale))]


def contenders(shape: str, k: int, folder: Path, scale: float, device: str) -> tuple[dict, dict]:
    model = Params(scaled(shape, scale)).to(device)
    src = [p.detach() for p in model.p]
    emas = [[s.clone() for s in src] for _ in range(k)]
    weights = [0.01 * (i + 1) for i in range(k)]
    weight_tensors = [torch.tensor(w, dtype=torch.float64, device=device) for w in weights]
    steps = {
        "lerp_many_": lambda: fused_ema.lerp_many_(emas, src, weights),
        "K x lerp_": lambda: [fused_ema.lerp_(e, src, w) for e, w in zip(emas, weight_tensors)],
    }
    phema = PostHocEma(model, sigma_rels(k))
    steps["PostHocEma.update"] = lambda: phema.update(model)
    unavailable = {}
    try:
        ema_pytorch = load_ema_pytorch()
        # PostHocEMA needs two EMAs at least: one is its KarrasEMA.
        peer = ema_pytorch.KarrasEMA(model, sigma_rel=sigma_rels(k)[0], update_every=1)
        if k == 1:
            steps["ema-pytorch PostHocEMA"] = peer.update
            return steps, unavailable
        peer = ema_pytorch.PostHocEMA(
            model,
            sigma_rels=tuple(sigma_rels(k)),
            update_every=1,
            checkpoint_every_num_steps=10**9,
            checkpoint_folder=str(folder / f"ema-pytorch-{shape}-{k}"),
        )
        steps["ema-pytorch PostHocEMA"] = peer.update
    except Exception as err:  # not installed: reported, not timed
        unavailable["ema-pytorch PostHocEMA"] = f"n/a: {type(err).__name__}: {err}"
    return steps, unavailable


def measure_updates(
    ks: list[int], rounds: int, folder: Path, bar, scale: float, device: str
) -> list[dict]:
    rows = []
    for shape in SHAPES:
        for k in ks:
            steps, unavailable = contenders(shape, k, folder, scale, device)
            with torch.no_grad():
                samples = interleaved(steps, rounds, 3, synchronizer(device), bar.update)
            row = {
                "shape": shape,
                "k": k,
                "elements": sum(scaled(shape, scale)),
                "unavailable": unavailable,
            }
            for name, times in samples.items():
                row[name] = summary(times)
            base = row["lerp_many_"]["median_ms"]
            row["lerp_many_ vs K lerp_"] = row["K x lerp_"]["median_ms"] / base
            peer = row.get("ema-pytorch PostHocEMA")
            if peer is not None:
                row["PostHocEma vs ema-pytorch"] = (
                    peer["median_ms"] / row["PostHocEma.update"]["median_ms"]
                )
            rows.append(row)
    return rows


def measure_snapshots(steps: int, blocks: int, folder: Path, bar, device: str) -> dict:
    """Median step time of a training loop with PostHocEma, snapshots every 100 updates or none,
    in interleaved blocks of `steps` steps (each block holds its share of snapshots)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device=device)
    sync = synchronizer(device)
    runs = {
        "no snapshots": PostHocEma(model, (0.05, 0.1)),
        "snapshot_every=100": PostHocEma(
            model, (0.05, 0.1), snapshot_every=100, snapshot_dir=folder / "snapshots"
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}

    def block(ph):
        start = time.perf_counter()
        for _ in range(steps):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ph.update(model)
        ph._tracks[0].synchronize()  # the update, not the snapshot writes: those stay behind
        sync()
        return (time.perf_counter() - start) / steps

    for r in range(blocks):
        for name in list(runs)[r % 2 :] + list(runs)[: r % 2]:
            times[name].append(block(runs[name]))
        bar.update(1)
    runs["snapshot_every=100"].close()
    written = len(list((folder / "snapshots").glob("*.safetensors")))
    out = {name: summary(t) for name, t in times.items()}
    base = out["no snapshots"]["median_ms"]
    out["overhead_pct"] = 100 * (out["snapshot_every=100"]["median_ms"] - base) / base
    out["snapshots_written"] = written
    out["parameters"] = sum(p.numel() for p in model.parameters())
    return out


def markdown(record: dict) -> str:
    m = record["machine"]
    where = m.get("gpu") or f"{m['cpu']} ({m['threads']} threads)"
    lines = [
        f"# Post-hoc EMA updates, {where}, torch {m['torch']}, Python {m['python']}, {m['date']}",
        "",
        "Median ms per update of K EMAs (interleaved rounds); ratios are speed-ups. At K = 1 the "
        "ema-pytorch column is its KarrasEMA (PostHocEMA needs 2 EMAs at least).",
        "",
        "| model | K | lerp_many_ | K x lerp_ | PostHocEma.update | ema-pytorch PostHocEMA "
        "| lerp_many_ vs K lerp_ | ceiling 2K/(K+1) | PostHocEma vs ema-pytorch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["updates"]:
        peer = row.get("ema-pytorch PostHocEMA")
        target = TARGETS.get((row["shape"], row["k"]))
        ratio = f"{row['lerp_many_ vs K lerp_']:.2f}x" + (f" (target {target}x)" if target else "")
        versus = row.get("PostHocEma vs ema-pytorch")
        cells = [
            f"{row['shape']} ({row['elements'] / 1e6:.1f}M)",
            str(row["k"]),
            f"{row['lerp_many_']['median_ms']:.2f}",
            f"{row['K x lerp_']['median_ms']:.2f}",
            f"{row['PostHocEma.update']['median_ms']:.2f}",
            f"{peer['median_ms']:.2f}" if peer else "n/a",
            ratio,
            f"{ceiling(row['k']):.2f}x",
            f"{versus:.1f}x" if versus else "n/a",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    snap = record["snapshots"]
    lines += [
        "",
        f"Snapshots: a training step of a {snap['parameters'] / 1e6:.1f}M-parameter MLP with "
        f"PostHocEma (2 EMAs): {snap['no snapshots']['median_ms']:.2f} ms without snapshots, "
        f"{snap['snapshot_every=100']['median_ms']:.2f} ms with snapshot_every=100 "
        f"({snap['overhead_pct']:+.1f}%, target <= 5%; {snap['snapshots_written']} files written).",
    ]
    return "\n".join(lines) + "\n"


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, shape in zip(axes, SHAPES):
        rows = [r for r in record["updates"] if r["shape"] == shape]
        ks = [r["k"] for r in rows]
        for name, color in (
            ("lerp_many_", "#2a7"),
            ("K x lerp_", "#888"),
            ("PostHocEma.update", "#27a"),
            ("ema-pytorch PostHocEMA", "#a52"),
        ):
            values = [r[name]["median_ms"] for r in rows if name in r]
            if len(values) == len(ks):
                ax.plot(ks, values, marker="o", label=name, color=color)
        ax.set_xlabel("EMAs (K)")
        ax.set_ylabel("ms per update (median)")
        ax.set_yscale("log")
        ax.set_xticks(ks)
        ax.set_title(f"{shape}: {rows[0]['elements'] / 1e6:.1f}M elements", fontsize=9)
        ax.legend(fontsize=7)
    m = record["machine"]
    where = m.get("gpu") or f"{m['cpu']} ({m['threads']} threads)"
    fig.suptitle(f"K EMAs, {where}, {m['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the model and its EMAs)")
    parser.add_argument("--ks", default="1,2,4,8", help="numbers of EMAs, comma-separated")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--snapshot-steps", type=int, default=100, help="steps per timed block")
    parser.add_argument("--snapshot-blocks", type=int, default=8)
    parser.add_argument("--scale", type=float, default=1.0, help="model size factor (tests)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",") if k]
    record = {"machine": report.machine([args.device]), "rounds": args.rounds, "scale": args.scale}
    record["device"] = args.device
    record["gammas"] = {k: [sigma_rel_to_gamma(s) for s in sigma_rels(k)] for k in ks}
    total = len(SHAPES) * len(ks) * args.rounds + args.snapshot_blocks
    with (
        tempfile.TemporaryDirectory() as tmp,
        tqdm(total=total, desc="posthoc", leave=False) as bar,
    ):
        record["updates"] = measure_updates(
            ks, args.rounds, Path(tmp), bar, args.scale, args.device
        )
        record["snapshots"] = measure_snapshots(
            args.snapshot_steps, args.snapshot_blocks, Path(tmp), bar, args.device
        )
    text = markdown(record)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"posthoc_{report.slug(record['machine'])}"
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    chart(record, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json, .md and .png")
    return record


if __name__ == "__main__":
    main()
