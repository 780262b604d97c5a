"""How much of the EMA's cost a training loop sees: the time of a real training step (forward,
backward, AdamW) with an EMA update, over the same step without one. Variants, interleaved:
the EMA on the model's device; on a GPU also a CPU EMA updated blocking and non_blocking (copies
on a side stream, CPU work on a worker thread). Targets: at most 1.05x on the model's device,
1.10x for a CPU EMA with non_blocking. The model: ViT-B/16 under bf16 autocast on a GPU (86.6M
parameters), an MLP of --width and --depth on the CPU (or with --model mlp).

    python -m benchmarks.training_loop [--device cuda] [--model vit_b16] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from pathlib import Path

import torch
from torch import nn

import fused_ema

from . import models, report
from .timing import interleaved, summary, synchronizer


def build_model(kind: str, width: int, depth: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "vit_b16":
        return models.randomize_(models.ViTB16()).to(device)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(device)


class Loop:
    """One training setup: its own model copy, optimizer, data and (optional) EMA."""

    def __init__(
        self,
        base: nn.Module,
        batch_input: torch.Tensor,
        ema: dict | None,
        non_blocking: bool = False,
        autocast: bool = False,
    ):
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = batch_input
        self.ema = fused_ema.ModelEma(self.model, **ema) if ema is not None else None
        self.non_blocking = non_blocking
        self.autocast = autocast

    def step(self) -> None:
        mixed = (
            torch.autocast(self.x.device.type, dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )
        with mixed:
            loss = self.model(self.x).float().square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model, non_blocking=self.non_blocking)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model", choices=["vit_b16", "mlp"], default=None, help="default: vit_b16 on a GPU"
    )
    parser.add_argument("--width", type=int, default=1024, help="the MLP's")
    parser.add_argument("--depth", type=int, default=8, help="the MLP's")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30, help="fine interleaving: the step")
    parser.add_argument("--reps", type=int, default=2, help="times differ by a few percent")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    device = args.device
    kind = args.model or ("vit_b16" if device.startswith("cuda") else "mlp")
    base = build_model(kind, args.width, args.depth, device)
    torch.manual_seed(1)
    if kind == "vit_b16":
        batch_input = torch.randn(args.batch, 3, 224, 224, device=device)
    else:
        batch_input = torch.randn(args.batch, args.width, device=device)
    amp = kind == "vit_b16" and device.startswith("cuda")
    variants = {
        "no EMA": Loop(base, batch_input, None, autocast=amp),
        "EMA on the model's device": Loop(base, batch_input, {"decay": 0.999}, autocast=amp),
    }
    if device.startswith("cuda"):
        cpu = {"decay": 0.999, "device": "cpu"}
        variants["CPU EMA, blocking"] = Loop(base, batch_input, cpu, autocast=amp)
        variants["CPU EMA, non_blocking"] = Loop(
            base, batch_input, cpu, non_blocking=True, autocast=amp
        )

    # A non_blocking step is timed as the loop sees it: the next update waits for the previous
    # one's CPU work only if that work is slower than a training step.
    steps = {name: loop.step for name, loop in variants.items()}
    samples = interleaved(steps, args.rounds, args.reps, synchronizer(device), budget_s=5.0)
    for loop in variants.values():
        if loop.ema is not None:
            loop.ema.synchronize()
    base_ms = summary(samples["no EMA"])["median_ms"]
    params = sum(p.numel() for p in base.parameters())
    record = {
        "machine": report.machine([device]),
        "device": device,
        "model": kind,
        "autocast": "bfloat16" if amp else None,
        "params": params,
        "batch": args.batch,
        "variants": {},
    }
    what = "ViT-B/16 (bf16 autocast)" if kind == "vit_b16" else "MLP"
    print(
        f"training step of a {params / 1e6:.1f}M-parameter {what}, batch {args.batch}, AdamW, "
        f"on {device}"
    )
    print(f"{'variant':28} {'median ms':>10} {'p25-p75 ms':>15} {'vs no EMA':>10}")
    for name, times in samples.items():
        stats = summary(times)
        stats["vs_no_ema"] = stats["median_ms"] / base_ms
        record["variants"][name] = stats
        print(
            f"{name:28} {stats['median_ms']:10.2f} "
            f"{stats['p25_ms']:7.2f}-{stats['p75_ms']:<7.2f} {stats['vs_no_ema']:9.3f}x"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"training_loop_{report.slug(record['machine'])}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
