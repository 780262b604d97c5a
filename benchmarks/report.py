"""Benchmark output: the terminal table, the JSON record and the PNG chart, plus the facts about
the machine that make a result reproducible (CPU model, threads, GPU, versions, date)."""

from __future__ import annotations

import datetime
import json
import platform
import re
from pathlib import Path

import torch

import fused_ema


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(devices: list[str]) -> dict:
    info = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "fused_ema": fused_ema.build_info(),
    }
    if any(d.startswith("cuda") for d in devices) and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def slug(info: dict) -> str:
    device = info.get("gpu") or f"{info['cpu']} {info['threads']}t"
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") + "_" + info["date"]


def table(record: dict) -> str:
    header = (
        f"{'scenario':32} {'contender':26} {'median ms':>10} {'p25-p75 ms':>15} "
        f"{'GB/s':>7} {'% copy':>7} {'vs foreach':>10}"
    )
    lines = [header, "-" * len(header)]
    for sc in record["scenarios"]:
        for c in sc["contenders"]:
            if c["status"].startswith("n/a"):
                continue
            if c["status"] != "ok":
                lines.append(f"{sc['title'][:32]:32} {c['name'][:26]:26} {c['status'][:90]}")
                continue
            spread = f"{c['p25_ms']:.2f}-{c['p75_ms']:.2f}"
            ratio = f"{c['vs_foreach']:.2f}x" if c.get("vs_foreach") else "-"
            lines.append(
                f"{sc['title'][:32]:32} {c['name'][:26]:26} {c['median_ms']:10.2f} {spread:>15} "
                f"{c['gbps']:7.1f} {c['pct_copy_bw']:6.0f}% {ratio:>10}"
            )
        if sc.get("compare_to"):
            parts = [
                f"{name} {v:.2f}x" if isinstance(v, float) else f"{name} {v}"
                for name, v in sc["vs_compare_to"].items()
            ]
            lines.append(f"  speed vs {sc['compare_to']}: " + "; ".join(parts))
        lines.append("")
    bw = record["copy_bandwidth_gbps"]
    lines.append(
        "copy bandwidth (same run): " + ", ".join(f"{d} {v:.1f} GB/s" for d, v in bw.items())
    )
    return "\n".join(lines)


def write(record: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / slug(record["machine"])
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")]
    paths[0].write_text(json.dumps(record, indent=2, default=str) + "\n")
    m = record["machine"]
    where = m.get("gpu") or m["cpu"]
    paths[1].write_text(
        f"# fused_ema benchmark: {where}\n\n{m['date']}, torch {m['torch']}, {m['threads']} CPU "
        f"threads, fused_ema {m['fused_ema']['version']} (CPU path {m['fused_ema']['cpu_isa']})"
        f"\n\n```\n{table(record)}\n```\n"
    )
    chart(record, paths[2])
    return paths


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = record["scenarios"]
    names = sorted(
        {c["name"] for sc in scenarios for c in sc["contenders"]},
        key=lambda n: (
            [c["name"] for c in scenarios[0]["contenders"]].index(n)
            if n in [c["name"] for c in scenarios[0]["contenders"]]
            else 99
        ),
    )
    fig, axes = plt.subplots(
        len(scenarios), 1, figsize=(8, 1.0 + 0.32 * len(names) * len(scenarios)), squeeze=False
    )
    for ax, sc in zip(axes[:, 0], scenarios):
        rows = [c for c in sc["contenders"] if not c["status"].startswith("n/a")]
        labels = [c["name"] for c in rows]
        values = [c.get("vs_foreach") or 0.0 for c in rows]
        colors = ["#2a7" if c["name"].startswith("fused_ema") else "#888" for c in rows]
        ax.barh(labels, values, color=colors)
        ax.axvline(1.0, color="black", linewidth=0.8)
        for y, c in enumerate(rows):
            text = (
                f"{c['vs_foreach']:.2f}x, {c['median_ms']:.1f} ms"
                if c["status"] == "ok"
                else c["status"].split(":")[0]
            )
            ax.text(max(values[y], 0.02), y, " " + text, va="center", fontsize=7)
        ax.set_title(sc["title"], fontsize=9, loc="left")
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, max(max(values) * 1.35, 1.5))
    axes[-1, 0].set_xlabel("speed relative to torch._foreach_lerp_ (higher is faster)")
    m = record["machine"]
    fig.suptitle(
        f"EMA update, {m.get('gpu') or m['cpu']} ({m['threads']} threads), "
        f"torch {m['torch']}, {m['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
