"""fused_ema's main benchmark: every EMA contender on realistic parameter lists, interleaved in one
run, each checked for a correct result before it is timed.

    python -m benchmarks.bench                       # quick mode (about two minutes on 2 cores)
    python -m benchmarks.bench --full                # more rounds
    python -m benchmarks.bench --scenarios many_small,llm_bf16 --devices cpu --rounds 5
    python -m benchmarks.bench --out benchmarks/results   # where the JSON, table and chart go
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from . import contenders as contenders_module
from . import models, report
from .accuracy import ulp
from .timing import copy_bandwidth, interleaved, summary, synchronizer

DECAY = 0.999


@dataclass
class Scenario:
    name: str
    title: str
    build: type
    model_dtype: torch.dtype = torch.float32
    ema_dtype: torch.dtype = torch.float32
    ema_device: str | None = None  # None: with the model
    gpu_only: bool = False
    contenders: tuple[str, ...] | None = None  # None: all; else only these (the rest are n/a)
    compare_to: str | None = None  # also report each stochastic contender's speed against this


STOCHASTIC = (
    contenders_module.ForeachLerp.name,  # round to nearest: the baseline of the "vs foreach" column
    contenders_module.FusedOp.name,  # round to nearest
    contenders_module.FusedStochastic.name,
    contenders_module.ModelEmaStochastic.name,
    contenders_module.TimmModelEmaV3Stochastic.name,
)


SCENARIOS = [
    Scenario("resnet50", "ResNet-50 (161 tensors, 25.6M)", models.ResNet50),
    Scenario("vit_b16", "ViT-B/16 (152 tensors, 86.6M)", models.ViTB16),
    Scenario("llm", "decoder LM (170 tensors, 338M)", models.DecoderLM),
    Scenario("many_small", "20,000 x 1,000 tensors", models.ManySmall),
    Scenario("llm_bf16", "fp32 EMA of bf16 LM (338M)", models.DecoderLM, torch.bfloat16),
    Scenario(
        "cpu_ema_of_cuda_model",
        "CPU EMA of a CUDA bf16 LM",
        models.DecoderLM,
        torch.bfloat16,
        ema_device="cpu",
        gpu_only=True,
    ),
    Scenario(
        "vit_bf16_sr",
        "bf16 EMA (SR) of bf16 ViT-B/16",
        models.ViTB16,
        torch.bfloat16,
        torch.bfloat16,
        contenders=STOCHASTIC,
        compare_to=contenders_module.TimmModelEmaV3Stochastic.name,
    ),
]


def param_bytes(model, ema_dtype) -> int:
    """The least an update must move: read and write the EMA, read the model."""
    ema_size = torch.empty((), dtype=ema_dtype).element_size()
    return sum(p.numel() * (2 * ema_size + p.element_size()) for p in model.parameters())


def check(contender, model, seed) -> str | None:
    """One update checked against a float64 reference on a sample of tensors; None if right.
    A stochastically rounding contender must also move sub-half-ulp updates by their expected
    amount (round to nearest leaves them where they are)."""
    models.perturb_(model, seed)
    names = [n for n, _ in model.named_parameters()]
    sample = names[:: max(1, len(names) // 12)] + names[-1:]
    params = dict(model.named_parameters())
    ema = contender.ema()
    before = {n: ema[n].detach().to("cpu", torch.float64).clone() for n in sample}
    target = {n: params[n].detach().to("cpu", torch.float64) for n in sample}
    contender.step()
    after = contender.ema()
    moved = expected = 0.0
    for n in sample:
        got = after[n].detach()
        if got.dtype != contender.ema_dtype:
            return f"wrong: keeps a {str(got.dtype).replace('torch.', '')} EMA"
        ref = before[n] + (1 - contender.decay) * (target[n] - before[n])
        err = (got.to("cpu", torch.float64) - ref).abs()
        bound = 4 * torch.finfo(got.dtype).eps * (before[n].abs() + target[n].abs()) + 1e-30
        if bool((err > bound).any()):
            return f"wrong: {n} off by up to {float(err.max()):.2e}"
        if contender.stochastic_rounding:
            unit = ulp(before[n], got.dtype)
            delta = ref - before[n]
            small = (delta.abs() < unit / 2) & (before[n] != 0)
            step = (got.to("cpu", torch.float64) - before[n])[small] / unit[small]
            moved += float((step * delta[small].sign()).sum())
            expected += float((delta[small].abs() / unit[small]).sum())
    if contender.stochastic_rounding:
        # each sub-half-ulp element moves one ulp with probability |delta| / ulp: the sum is
        # `expected` within a few sqrt(expected); round to nearest moves none
        if expected < 1000:
            return f"unchecked: too few sub-half-ulp updates to test rounding ({expected:.0f})"
        if abs(moved / expected - 1) > 0.2:
            return (
                f"wrong: not stochastic rounding (sub-half-ulp updates moved {moved / expected:.2f}"
                " of their expected amount, want 1)"
            )
    return None


def run_scenario(sc: Scenario, device: str, args, on_round) -> dict:
    torch.manual_seed(0)
    model = models.randomize_(sc.build()).to(device=device, dtype=sc.model_dtype)
    entry = {
        "name": sc.name,
        "title": sc.title if device == "cpu" else f"{sc.title} [{device}]",
        "device": device,
        "ema_device": sc.ema_device or device,
        "params": sum(p.numel() for p in model.parameters()),
        "tensors": sum(1 for _ in model.parameters()),
        "model_dtype": str(sc.model_dtype),
        "ema_dtype": str(sc.ema_dtype),
        "bytes": param_bytes(model, sc.ema_dtype),
        "contenders": [],
    }
    steps, prepare, results = {}, {}, {}
    for k, cls in enumerate(contenders_module.ALL):
        result = {"name": cls.name, "status": "ok"}
        results[cls.name] = result
        if sc.contenders is not None and cls.name not in sc.contenders:
            result["status"] = "n/a: not in this scenario"
            continue
        reason = cls.unavailable()
        if reason:
            result["status"] = reason
            continue
        reason = cls.applies(model, sc.ema_dtype)
        if reason:
            result["status"] = reason
            continue
        try:
            contender = cls(model, DECAY, sc.ema_dtype, sc.ema_device)
            contender.prime()
            problem = check(contender, model, seed=100 + k) if cls.checked else None
        except Exception as err:  # a library failing on this scenario is a result
            problem = f"fails: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        if problem and problem.startswith("wrong") and getattr(contender, "note", ""):
            problem = f"{problem} ({contender.note})"
        if problem:
            result["status"] = problem
        else:
            steps[cls.name] = contender.step
            prepare[cls.name] = contender.prepare
    sync = synchronizer(device)
    samples = interleaved(steps, args.rounds, args.reps, sync, on_round, prepare=prepare)
    for name, result in results.items():
        if name in samples:
            stats = summary(samples[name])
            stats["gbps"] = entry["bytes"] / (stats["median_ms"] / 1e3) / 1e9
            result.update(stats)
        entry["contenders"].append(result)
    baseline = results.get(contenders_module.BASELINE, {}).get("median_ms")
    for result in entry["contenders"]:
        if baseline and "median_ms" in result:
            result["vs_foreach"] = baseline / result["median_ms"]
    if sc.compare_to:
        reference = results.get(sc.compare_to, {})
        entry["compare_to"] = sc.compare_to
        entry["vs_compare_to"] = {}
        for cls in contenders_module.ALL:
            result = results[cls.name]
            if not cls.stochastic_rounding or cls.name == sc.compare_to:
                continue
            if "median_ms" in result and "median_ms" in reference:
                entry["vs_compare_to"][cls.name] = reference["median_ms"] / result["median_ms"]
            else:  # why there is no ratio: its status, or the reference's
                entry["vs_compare_to"][cls.name] = (
                    result["status"] if result["status"] != "ok" else reference.get("status")
                )
    del steps, model
    gc.collect()
    return entry


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    names = [s.name for s in SCENARIOS]
    parser.add_argument(
        "--scenarios", default=",".join(names), help=f"comma-separated, from: {', '.join(names)}"
    )
    default_devices = "cpu,cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--devices", default=default_devices, help="cpu and/or cuda")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--reps", type=int, default=None, help="calls per contender per round")
    parser.add_argument(
        "--full", action="store_true", help="more rounds (18 x 2 calls instead of 9 x 1)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/out"),
        help="directory for the JSON, the table (.md) and the chart (.png)",
    )
    args = parser.parse_args(argv)
    # many short rounds: contenders alternate finely, so drift in the machine's load spreads evenly
    args.rounds = args.rounds or (18 if args.full else 9)
    args.reps = args.reps or (2 if args.full else 1)
    wanted = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(wanted) - set(names))
    if unknown or not wanted:
        parser.error(f"unknown --scenarios {unknown}; choose from {', '.join(names)}")
    chosen = [s for s in SCENARIOS if s.name in wanted]
    devices = [d for d in args.devices.split(",") if d]
    if not devices or set(devices) - {"cpu", "cuda"}:
        parser.error(f"--devices {args.devices!r}: give cpu and/or cuda")
    if "cuda" in devices and not torch.cuda.is_available():
        parser.error("--devices cuda, but no GPU is visible")

    record = {
        "machine": report.machine(devices),
        "decay": DECAY,
        "copy_bandwidth_gbps": {},
        "scenarios": [],
    }
    for device in devices:
        record["copy_bandwidth_gbps"][device] = copy_bandwidth(device)
    jobs = [
        (sc, d)
        for d in devices
        for sc in chosen
        if not (sc.gpu_only and d == "cpu") and not (sc.ema_device == "cpu" and d == "cpu")
    ]
    if not jobs:
        parser.error(
            f"none of {', '.join(wanted)} runs on {', '.join(devices)} (GPU-only scenarios)"
        )
    with tqdm(total=len(jobs) * args.rounds, desc="benchmark", unit="round", leave=False) as bar:
        for sc, device in jobs:
            bar.set_postfix_str(f"{sc.name} on {device}")
            record["scenarios"].append(run_scenario(sc, device, args, lambda: bar.update(1)))
    for device in devices:  # once more at the end; the better reading is the machine's ceiling
        record["copy_bandwidth_gbps"][device] = max(
            record["copy_bandwidth_gbps"][device], copy_bandwidth(device)
        )
    for entry in record["scenarios"]:
        bw = record["copy_bandwidth_gbps"][entry["device"]]
        for c in entry["contenders"]:
            if "gbps" in c:
                c["pct_copy_bw"] = 100 * c["gbps"] / bw
    print(report.table(record))
    for path in report.write(record, args.out):
        print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
