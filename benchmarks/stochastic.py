"""CPU cost of stochastic rounding against round to nearest, per CPU path and dtype pair, on
ViT-B/16's parameter list (152 tensors, 86.6M elements): lerp_stochastic_ against lerp_, lerp_many_
(2 tracks) with seeds against without, ModelEma with stochastic_rounding on against off; each pair
interleaved, medians. Optionally timm 1.0.31's scheme in torch ops (slow: 8 passes).

    python -m benchmarks.stochastic                          # every pair and CPU path, 9 rounds
    python -m benchmarks.stochastic --pairs bf16/bf16 --isas avx2 --rounds 5 --timm
    python -m benchmarks.stochastic --out benchmarks/results # what was committed

Writes stochastic_<machine>_<date>_py<X.Y>-torch<X.Y>.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import torch

import fused_ema

from . import report
from .models import ViTB16
from .timing import interleaved, summary, synchronizer

DECAY = 0.9999
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
RANDOM_BITS = 16
KEEP_HIGH_HALF = -(1 << RANDOM_BITS)  # 0xFFFF0000 as an int32


def timm_stochastic_update(ema: list[torch.Tensor], src: list[torch.Tensor], decay: float):
    """timm's bfloat16 EMA step with stochastic rounding, in torch ops: average in float32, add 16
    random bits below the bfloat16 half, truncate, copy back."""
    ema32 = torch.cat([e.reshape(-1) for e in ema]).float()
    src32 = torch.cat([s.reshape(-1) for s in src]).float()
    ema32.mul_(decay).add_(src32, alpha=1.0 - decay)
    bits = ema32.view(torch.int32)
    bits.add_(torch.randint(0, 1 << RANDOM_BITS, bits.shape, dtype=torch.int32))
    bits.bitwise_and_(KEEP_HIGH_HALF)
    rounded = ema32.to(torch.bfloat16)  # exact: the low half is zero
    for e, part in zip(ema, rounded.split([e.numel() for e in ema])):
        e.copy_(part.view_as(e))


def contenders(ema_dtype: torch.dtype, src_dtype: torch.dtype, timm: bool, dim: int) -> dict:
    """name -> step, in (nearest, stochastic) pairs."""
    model = ViTB16(dim=dim).to(src_dtype)
    src = [p.detach() for p in model.parameters()]

    def emas():
        return [s.to(ema_dtype, copy=True) for s in src]

    plain, rounded = emas(), emas()
    many_plain, many_rounded = [emas(), emas()], [emas(), emas()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fused_ema.PrecisionWarning)
        ema_plain = fused_ema.ModelEma(model, DECAY, dtype=ema_dtype, stochastic_rounding=False)
        ema_rounded = fused_ema.ModelEma(model, DECAY, dtype=ema_dtype, stochastic_rounding=True)
    step = [0]

    def lerp_stochastic():
        step[0] += 1
        fused_ema.lerp_stochastic_(rounded, src, 1.0 - DECAY, seed=0, step=step[0])

    def many_stochastic():
        step[0] += 1
        fused_ema.lerp_many_(many_rounded, src, [1e-3, 1e-4], seed=0, step=step[0])

    steps = {
        "lerp_ (nearest)": lambda: fused_ema.lerp_(plain, src, 1.0 - DECAY),
        "lerp_stochastic_": lerp_stochastic,
        "lerp_many_ K=2 (nearest)": lambda: fused_ema.lerp_many_(many_plain, src, [1e-3, 1e-4]),
        "lerp_many_ K=2 stochastic": many_stochastic,
        "ModelEma.update (nearest)": lambda: ema_plain.update(model),
        "ModelEma.update stochastic": lambda: ema_rounded.update(model),
    }
    if timm and ema_dtype == torch.bfloat16:
        timm_ema = emas()
        steps["timm 1.0.31 scheme"] = lambda: timm_stochastic_update(timm_ema, src, DECAY)
    return steps


def measure(isa: str, pair: str, rounds: int, timm: bool, dim: int) -> list[dict]:
    fused_ema.set_cpu_isa(isa)
    ema_dtype, src_dtype = (DTYPES[d] for d in pair.split("/"))
    steps = contenders(ema_dtype, src_dtype, timm, dim)
    samples = interleaved(steps, rounds, reps=3, sync=synchronizer("cpu"))
    medians = {name: statistics.median(times) for name, times in samples.items()}
    names = list(steps)
    rows = []
    for nearest, rounded in zip(names[0::2], names[1::2]):
        rows.append(
            {
                "isa": isa,
                "pair": pair,
                "op": nearest.replace(" (nearest)", ""),
                "nearest": summary(samples[nearest]),
                "stochastic": summary(samples[rounded]),
                "ratio": medians[rounded] / medians[nearest],
            }
        )
    if "timm 1.0.31 scheme" in medians:
        rows[0]["timm_ms"] = medians["timm 1.0.31 scheme"] * 1e3
    return rows


def table(record: dict) -> str:
    header = (
        f"{'CPU path':8} {'ema/src':9} {'op':16} {'nearest ms':>11} {'p25-p75':>13} "
        f"{'stochastic ms':>14} {'p25-p75':>13} {'SR/RN':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in record["rows"]:
        rn, sr = r["nearest"], r["stochastic"]
        lines.append(
            f"{r['isa']:8} {r['pair']:9} {r['op']:16} {rn['median_ms']:11.2f} "
            f"{rn['p25_ms']:6.2f}-{rn['p75_ms']:<6.2f} {sr['median_ms']:14.2f} "
            f"{sr['p25_ms']:6.2f}-{sr['p75_ms']:<6.2f} {r['ratio']:5.2f}x"
        )
        if "timm_ms" in r:
            lines.append(f"{'':35}timm 1.0.31's scheme in torch ops: {r['timm_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", default="bf16/bf16,bf16/f32,f16/f16,f32/bf16", help="ema/src")
    parser.add_argument("--isas", default="avx512,avx2", help="CPU paths, where available")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--timm", action="store_true", help="also time timm's scheme (bf16)")
    parser.add_argument("--dim", type=int, default=768, help="ViT width (smaller: a smoke test)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    available = fused_ema.build_info()["cpu_isas_available"]
    isas = [isa for isa in args.isas.split(",") if isa in available]
    previous = fused_ema.cpu_isa()
    numel = sum(p.numel() for p in ViTB16(dim=args.dim).parameters())
    record = {"machine": report.machine(["cpu"]), "rounds": args.rounds, "elements": numel}
    record["rows"] = []
    try:
        for isa in isas:
            for pair in args.pairs.split(","):
                record["rows"] += measure(isa, pair, args.rounds, args.timm, args.dim)
    finally:
        fused_ema.set_cpu_isa(previous)
    m = record["machine"]
    text = (
        f"# Stochastic rounding against round to nearest: {m['cpu']}\n\n{m['date']}, torch "
        f"{m['torch']}, {m['threads']} threads; ViT-B/16's parameter list (152 tensors, "
        f"{numel:,} elements), medians of {args.rounds} interleaved rounds (3 calls each); "
        "lerp_many_ with 2 tracks (weights 1e-3, 1e-4), the others at decay 0.9999.\n\n"
        f"```\n{table(record)}\n```\n"
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    python = ".".join(m["python"].split(".")[:2])
    torch_version = ".".join(m["torch"].split("+")[0].split(".")[:2])
    stem = args.out / f"stochastic_{report.slug(m)}_py{python}-torch{torch_version}"
    Path(f"{stem}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    Path(f"{stem}.md").write_text(text)
    print(f"wrote {stem}.json and .md")
    return record


if __name__ == "__main__":
    main()
