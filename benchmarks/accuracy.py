"""How accurate is a bf16 EMA? Each method averages the same bf16 weights step after step, and is
compared with the exact (float64) EMA of those weights:

- float32 EMA (fused_ema.lerp_, bf16 weights into an fp32 EMA),
- bf16 EMA rounded to nearest (fused_ema.lerp_, bf16 into bf16),
- bf16 EMA with stochastic rounding by fused_ema.lerp_stochastic_ (pending until it exists),
- bf16 EMA with stochastic rounding by timm 1.0.31 (its real `_lerp_stochastic_round_bf16_`,
  loaded from timm/utils/model_ema.py alone, see benchmarks/peers.py).

Two sources of weights: (a) "drift", a synthetic target (a random walk plus a slow per-element
drift, 100k elements by default) and (b) "mlp", the weights of a small MLP trained with AdamW on
a synthetic regression task (76k parameters). For each decay (0.999 and 0.9999 by default):

- relative RMS error against the float64 EMA, over the steps (the chart) and at the end;
- stalled: the fraction of elements that never changed over the last --stall-window steps while
  the float64 EMA moved by more than half a bf16 ulp (round to nearest stops there);
- bias: the mean error in bf16 ulps of each element (elements whose float64 EMA is at least
  1/8 of the RMS, where an ulp means something, see ulp_errors); for the stochastic methods over
  --replicas independent replicas of a --replica-elements subset (timm: one call over the
  replicas, its generator drawing different bits for each; fused: per-replica keys), which must
  be within 0.1 ulp of zero.

    python -m benchmarks.accuracy                  # 10,000 steps, about 3 minutes on 2 cores
    python -m benchmarks.accuracy --steps 2000     # shorter
    python -m benchmarks.accuracy --out benchmarks/results   # what was committed

Writes accuracy_<machine>_<date>.json, .md and .png to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import fused_ema

from . import peers, report

BF16 = torch.bfloat16
UNBIASED_ULP = 0.1  # |mean error| of a stochastic method over the replicas must stay below this

FP32 = "float32 (fused_ema.lerp_)"
NEAREST = "bf16 nearest (fused_ema.lerp_)"
FUSED_SR = "bf16 stochastic (fused_ema.lerp_stochastic_)"
TIMM_SR = "bf16 stochastic (timm 1.0.31)"
METHODS = (FP32, NEAREST, FUSED_SR, TIMM_SR)
STOCHASTIC = (FUSED_SR, TIMM_SR)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` numbers at each |x| (float64 out): 2**(e - 1) * eps for
    x = m * 2**e with 0.5 <= |m| < 1, and the subnormal spacing for zero and tiny x."""
    finfo = torch.finfo(dtype)
    x = x.detach().double()
    _, exponent = torch.frexp(x)
    spacing = torch.ldexp(torch.full_like(x, finfo.eps / 2), exponent)
    floor = finfo.tiny * finfo.eps
    return torch.where(x == 0, torch.full_like(x, floor), spacing.clamp_min(floor))


def ulp_errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Errors of x against the float64 EMA in bf16 ulps of each element, over the elements whose
    float64 EMA is at least 1/8 of the RMS of ref (returned as a mask). Near zero a bf16 ulp is
    tiny: an element that was large a few hundred steps ago carries rounding noise of its old
    ulps, thousands of its current ones, which would swamp any mean."""
    kept = ref.abs() >= ref.square().mean().sqrt() / 8
    return (x.double() - ref)[..., kept] / ulp(ref[kept], BF16), kept


# --- the weights averaged -------------------------------------------------------------------


class Drift:
    """x_t = x_{t-1} + sigma * noise + drift (a fixed random direction per element); the model's
    weights are x_t in bf16."""

    name = "drift"

    def __init__(self, elements: int, seed: int = 0, sigma: float = 2e-3, drift: float = 3e-5):
        self.g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(elements, generator=self.g, dtype=torch.float64)
        self.drift = drift * torch.randn(elements, generator=self.g, dtype=torch.float64)
        self.sigma = sigma
        self.noise = torch.empty(elements)  # float32 noise: 4x cheaper to draw than float64
        self.title = f"random walk + drift, {elements:,} elements"

    def weights(self) -> torch.Tensor:
        return self.x.to(BF16)

    def step(self) -> torch.Tensor:
        self.noise.normal_(generator=self.g)
        self.x.add_(self.noise, alpha=self.sigma).add_(self.drift)
        return self.weights()

    def summary(self) -> dict:
        return {"sigma": self.sigma, "drift": float(self.drift.abs().mean())}


class MlpTraining:
    """An MLP (32 -> width -> width -> 8, GELU) fit with AdamW to a fixed random teacher network
    plus noise, fresh data every step; the model's weights are its parameters in bf16 (the
    flattened parameter list, as a bf16 model would hold them)."""

    name = "mlp"

    def __init__(self, width: int, seed: int = 0, batch: int = 64, lr: float = 1e-3):
        torch.manual_seed(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        self.model = nn.Sequential(
            nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.batch, self.lr = batch, lr
        self.losses: list[float] = []
        n = sum(p.numel() for p in self.model.parameters())
        self.title = f"MLP trained with AdamW, {n:,} parameters"

    def weights(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).to(BF16)

    def step(self) -> torch.Tensor:
        x = torch.randn(self.batch, 32, generator=self.g)
        with torch.no_grad():
            y = self.teacher(x) + 0.1 * torch.randn(self.batch, 8, generator=self.g)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())
        return self.weights()

    def summary(self) -> dict:
        head = sum(self.losses[:100]) / max(1, len(self.losses[:100]))
        tail = sum(self.losses[-100:]) / max(1, len(self.losses[-100:]))
        return {"loss_first_100": head, "loss_last_100": tail, "lr": self.lr}


SOURCES = {"drift": Drift, "mlp": MlpTraining}


# --- the EMAs --------------------------------------------------------------------------------


def method_status() -> dict[str, str]:
    status = {m: "ok" for m in METHODS}
    if peers.fused_stochastic_missing():
        status[FUSED_SR] = peers.fused_stochastic_missing()
    reason = peers.timm_missing(stochastic_rounding=True)
    if reason:
        status[TIMM_SR] = f"skipped: {reason}"
    return status


class Run:
    """Every method's EMA at one decay, with its metrics."""

    def __init__(self, decay: float, weights: torch.Tensor, status, timm_fn, args, seed: int):
        self.decay, self.w = decay, 1.0 - decay
        self.status, self.timm_fn, self.seed = status, timm_fn, seed
        self.ref = weights.double()
        self.ema = {}
        for m in METHODS:
            if status[m] == "ok":
                self.ema[m] = weights.float() if m == FP32 else weights.clone()
        n = weights.numel()
        count = min(args.replica_elements, n)
        self.subset = torch.linspace(0, n - 1, count, dtype=torch.float64).long()
        self.replicas = {
            m: [weights[self.subset].clone() for _ in range(args.replicas)]
            for m in STOCHASTIC
            if m in self.ema
        }
        self.timm_gen = torch.Generator().manual_seed(seed)
        self.timm_replica_gen = torch.Generator().manual_seed(seed + 1)
        self.curve = {m: [] for m in self.ema}
        self.window_start = None
        self.prev, self.changed = {}, {}
        self.seconds = dict.fromkeys(self.ema, 0.0)

    def update(self, t: int, weights: torch.Tensor, weights64, in_window: bool) -> None:
        w = self.w
        self.ref.lerp_(weights64, w)
        if in_window and self.window_start is None:
            self.window_start = self.ref.clone()
            self.prev = {m: e.clone() for m, e in self.ema.items()}
            self.changed = {m: torch.zeros_like(e, dtype=torch.bool) for m, e in self.ema.items()}
        for m, e in self.ema.items():
            start = time.perf_counter()
            if m in (FP32, NEAREST):
                fused_ema.lerp_([e], [weights], w)
            elif m == FUSED_SR:
                fused_ema.lerp_stochastic_([e], [weights], w, seed=self.seed, step=t)
            else:
                self.timm_fn([e], [weights], w, generator=self.timm_gen)
            self.seconds[m] += time.perf_counter() - start
            if in_window:
                self.changed[m] |= e != self.prev[m]
                self.prev[m].copy_(e)
        if self.replicas:
            sub = weights[self.subset]
            for m, reps in self.replicas.items():
                srcs = [sub] * len(reps)
                if m == FUSED_SR:
                    keys = list(range(len(reps)))
                    fused_ema.lerp_stochastic_(reps, srcs, w, seed=self.seed, step=t, keys=keys)
                else:
                    self.timm_fn(reps, srcs, w, generator=self.timm_replica_gen)

    def record(self, t: int) -> None:
        norm = float(self.ref.norm())
        for m, e in self.ema.items():
            self.curve[m].append((t, float((e.double() - self.ref).norm()) / max(norm, 1e-300)))

    def results(self, steps: int) -> dict:
        out = {}
        unit = ulp(self.ref, BF16)
        _, kept = ulp_errors(self.ref, self.ref)
        moved = (
            (self.ref - self.window_start).abs() > unit / 2
            if self.window_start is not None
            else torch.zeros_like(self.ref, dtype=torch.bool)
        )
        for m in METHODS:
            if m not in self.ema:
                out[m] = {"status": self.status[m]}
                continue
            e = self.ema[m].double()
            error_ulp, _ = ulp_errors(e, self.ref)
            row = {
                "status": "ok",
                "rel_rms": self.curve[m][-1][1],
                "mean_error_ulp": float(error_ulp.mean()),
                "rms_error_ulp": float(error_ulp.square().mean().sqrt()),
                "ulp_elements_fraction": float(kept.double().mean()),
                "us_per_step": 1e6 * self.seconds[m] / steps,
                "curve": self.curve[m],
            }
            if self.window_start is not None:
                stalled = moved & ~self.changed[m]
                row["stalled_fraction"] = float(stalled.double().mean())
                row["moved_fraction"] = float(moved.double().mean())
            if m in self.replicas:
                ref = self.ref[self.subset]
                errors, _ = ulp_errors(torch.stack(self.replicas[m]), ref)
                bias = float(errors.mean())
                # replicas are independent; elements of one replica share only the weights
                per_replica = errors.mean(dim=1)
                stderr = float(per_replica.std() / math.sqrt(len(per_replica)))
                row.update(
                    replicas=len(self.replicas[m]),
                    replica_elements=int(ref.numel()),
                    replica_elements_in_bias=int(errors.shape[1]),
                    replica_bias_ulp=bias,
                    replica_bias_stderr_ulp=stderr,
                    unbiased=abs(bias) <= UNBIASED_ULP,
                )
            out[m] = row
        return out


def run_case(source, args, status, timm_fn, bar) -> dict:
    weights = source.weights()
    runs = [Run(d, weights, status, timm_fn, args, seed=args.seed) for d in args.decays]
    every = max(1, args.steps // args.points)
    window = min(args.stall_window, args.steps)
    start = time.perf_counter()
    for run in runs:
        run.record(0)
    for t in range(1, args.steps + 1):
        weights = source.step()
        weights64 = weights.double()
        in_window = t > args.steps - window
        for run in runs:
            run.update(t, weights, weights64, in_window)
            if t % every == 0 or t == args.steps:
                run.record(t)
        bar.update(1)
    return {
        "case": source.name,
        "title": source.title,
        "elements": int(weights.numel()),
        "source": source.summary(),
        "stall_window": window,
        "seconds": time.perf_counter() - start,
        "decays": [{"decay": r.decay, "methods": r.results(args.steps)} for r in runs],
    }


# --- output ----------------------------------------------------------------------------------


def _pct(x):
    return "-" if x is None else f"{100 * x:.2f}%"


def table(record: dict) -> str:
    header = (
        f"{'case':6} {'decay':7} {'method':45} {'rel RMS err':>11} {'stalled':>8} "
        f"{'mean err':>9} {'RMS err':>8} {'bias over replicas':>22}"
    )
    lines = [header, f"{'':61} {'':>11} {'':>8} {'(ulp)':>9} {'(ulp)':>8} {'(ulp, ± std err)':>22}"]
    lines.append("-" * len(header))
    for case in record["cases"]:
        for entry in case["decays"]:
            for m, row in entry["methods"].items():
                prefix = f"{case['case']:6} {entry['decay']:<7} {m:45}"
                if row["status"] != "ok":
                    lines.append(f"{prefix} {row['status']}")
                    continue
                bias = "-"
                if "replica_bias_ulp" in row:
                    verdict = "ok" if row["unbiased"] else "BIASED"
                    bias = (
                        f"{row['replica_bias_ulp']:+.4f} ± {row['replica_bias_stderr_ulp']:.4f} "
                        f"{verdict}"
                    )
                lines.append(
                    f"{prefix} {row['rel_rms']:11.3e} {_pct(row.get('stalled_fraction')):>8} "
                    f"{row['mean_error_ulp']:+9.3f} {row['rms_error_ulp']:8.3f} {bias:>22}"
                )
        lines.append("")
    pending = [m for m, s in record["status"].items() if s != "ok"]
    for m in pending:
        lines.append(f"{m}: {record['status'][m]}")
    lines.append(
        f"{record['steps']:,} steps; stalled: unchanged over the last {record['stall_window']:,} "
        "steps while the float64 EMA moved > 0.5 ulp; bias: mean error over "
        f"{record['replicas']} replicas, must be within {UNBIASED_ULP} ulp of 0; errors in ulps "
        "count elements whose float64 EMA is >= RMS/8"
    )
    return "\n".join(lines)


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = record["cases"]
    ncols = max(len(c["decays"]) for c in cases)
    fig, axes = plt.subplots(
        len(cases), ncols, figsize=(5.5 * ncols, 3.6 * len(cases)), squeeze=False
    )
    colors = {FP32: "#555", NEAREST: "#c33", FUSED_SR: "#2a7", TIMM_SR: "#37c"}
    for i, case in enumerate(cases):
        for j, entry in enumerate(case["decays"]):
            ax = axes[i, j]
            for m, row in entry["methods"].items():
                if row["status"] != "ok":
                    continue
                steps, errors = zip(*row["curve"])
                ax.plot(steps, [max(e, 1e-12) for e in errors], label=m, color=colors[m], lw=1.2)
            ax.set_yscale("log")
            ax.set_title(f"{case['title']}, decay {entry['decay']}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("relative RMS error vs float64 EMA")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(record: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"accuracy_{report.slug(record['machine'])}"
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")]
    paths[0].write_text(json.dumps(record, indent=2, default=str) + "\n")
    m = record["machine"]
    paths[1].write_text(
        f"# fused_ema accuracy of bf16 EMAs: {m['cpu']}\n\n{m['date']}, torch {m['torch']}, "
        f"timm {record['timm']}, fused_ema {m['fused_ema']['version']}\n\n"
        f"```\n{table(record)}\n```\n\n![error vs step]({paths[2].name})\n"
    )
    chart(record, paths[2])
    return paths


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--decays", default="0.999,0.9999", help="comma-separated")
    parser.add_argument("--cases", default="drift,mlp", help="comma-separated: drift, mlp")
    parser.add_argument("--elements", type=int, default=100_000, help="size of the drift case")
    parser.add_argument("--mlp-width", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--replica-elements", type=int, default=2048)
    parser.add_argument("--stall-window", type=int, default=1000)
    parser.add_argument("--points", type=int, default=200, help="points of each error curve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (the results do not depend on it; on a busy 2-core machine one "
        "thread avoids OpenMP waits on these small tensors)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    args.decays = [float(d) for d in args.decays.split(",") if d]
    machine = report.machine(["cpu"])  # before the thread count changes: names the machine
    torch.set_num_threads(args.threads)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(SOURCES)
    if unknown:
        parser.error(f"unknown --cases {sorted(unknown)}; choose from {sorted(SOURCES)}")

    timm_fn = None
    if not peers.timm_missing(stochastic_rounding=True):
        timm_fn = peers.load_timm_model_ema()._lerp_stochastic_round_bf16_
    status = method_status()
    record = {
        "machine": machine,
        "threads_used": args.threads,
        "timm": peers.timm_version(),
        "steps": args.steps,
        "stall_window": min(args.stall_window, args.steps),
        "replicas": args.replicas,
        "status": status,
        "cases": [],
    }
    with tqdm(total=args.steps * len(cases), desc="accuracy", unit="step", leave=False) as bar:
        for name in cases:
            bar.set_postfix_str(name)
            if name == "drift":
                source = Drift(args.elements, seed=args.seed)
            else:
                source = MlpTraining(args.mlp_width, seed=args.seed)
            record["cases"].append(run_case(source, args, status, timm_fn, bar))
    print(table(record))
    for path in write(record, args.out):
        print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
