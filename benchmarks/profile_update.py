"""A profile trace of one ModelEma.update on a ViT-B/16 (86.6M float32 parameters, 152 tensors):
the host work and the kernels of one update after warm-up, as a Chrome trace (open it in
chrome://tracing or Perfetto) and a table of the top operations.

    python -m benchmarks.profile_update [--device cuda] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import gzip
import shutil
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fused_ema

from . import models, report


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = models.randomize_(models.ViTB16()).to(args.device)
    ema = fused_ema.ModelEma(model, decay=0.9999)
    for _ in range(5):  # warm-up: the update plan, caches, lazy CUDA init
        ema.update(model)
    if args.device == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=False) as prof:
        with torch.profiler.record_function("ModelEma.update"):
            ema.update(model)
        if args.device == "cuda":
            torch.cuda.synchronize()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"profile_update_vit_b16_{report.slug(report.machine([args.device]))}"
    trace = args.out / f"{stem}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    sort = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=15)
    (args.out / f"{stem}.txt").write_text(table + "\n")
    print(table)
    print(f"wrote {trace}.gz")
    return Path(f"{trace}.gz")


if __name__ == "__main__":
    main()
