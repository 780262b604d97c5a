"""Host overhead per model tensor of an EMA update on tiny tensors (blocks of nn.Linear(4, 4) and
nn.LayerNorm(4) in nested containers, float32, CPU), where the cost is all bookkeeping: the fused
kernel over the tensors ModelEma.update averages (its EMA tensors, the model's parameters), the same
call with weight 0 (its checks, plan and bookkeeping without the kernel), the same elements as
one flat tensor (the kernel's memory traffic without any per-tensor work), foreach,
ModelEma.update, and the check that the model still holds the planned tensor objects (what they
hold, the prepared update checks): the cached one an unchanged model takes (_C.walk_unchanged) and
the full one a changed model falls back to (_C.tensor_walk + walk_matches + the plan's taker).
Medians of interleaved runs of this thread's CPU time, on one torch thread: on a shared machine,
wall time and OpenMP barriers would measure the other tenants instead of the bookkeeping.

Before Python 3.12 there is no walk cache (it watches the model's dicts with CPython's dict
watchers, new in 3.12): every update takes the full walk check, and the cached one is reported
n/a with that reason.

    python -m benchmarks.overhead [--sizes 100,1000,3000,10000] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import weakref
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import fused_ema
from fused_ema import _C
from fused_ema._model.walk import tensor_walk
from fused_ema._update.plan import taker

from . import report
from .timing import summary

DECAY = 0.999
CONTENDERS = (
    "fused_ema.lerp_",
    "lerp_ weight 0",
    "one flat tensor",
    "torch._foreach_lerp_",
    "ModelEma.update",
    "cached walk check",
    "full C walk check",
    "Python tensor_walk",
)
# The acceptance ratio: an update over the fused call it makes.
RATIO = ("ModelEma.update", "fused_ema.lerp_")
CACHED_CHECK = "cached walk check"


def walk_cache_missing() -> str | None:
    """Why this Python has no walk cache (so CACHED_CHECK cannot be measured), or None."""
    if sys.version_info < (3, 12):
        return (
            f"n/a: no walk cache on Python {sys.version_info.major}.{sys.version_info.minor} "
            "(it needs CPython's dict watchers, 3.12+); every update takes the full walk check"
        )
    return None


def build_model(tensors: int) -> nn.Module:
    """tensors / 4 blocks of Linear(4, 4) + LayerNorm(4) (4 tensors each) in ModuleLists of 8
    inside one Sequential, so the walk meets three container levels."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(max(1, tensors // 4))]
    return nn.Sequential(*(nn.ModuleList(blocks[i : i + 8]) for i in range(0, len(blocks), 8)))


def steps(model: nn.Module) -> tuple[dict, dict]:
    """The timed calls by contender name, and why each contender left out was left out."""
    ema_model = fused_ema.ModelEma(model, DECAY)
    # The very tensors ModelEma.update averages: its EMA tensors and the model's parameters.
    ema = list(ema_model.module.parameters())
    src = list(model.parameters())
    flat_ema = torch.cat([t.detach().reshape(-1) for t in ema])
    flat_src = torch.cat([t.detach().reshape(-1) for t in src])
    walk = _C.tensor_walk(model, True)
    refs = tuple(None if t is None else weakref.ref(t) for t in walk)
    indices = tuple(i for i, t in enumerate(walk) if t is not None)
    cache = _C.walk_cache(model, True, walk)  # None where this Python has no walk cache
    unavailable = {}
    if cache is None:
        unavailable[CACHED_CHECK] = walk_cache_missing() or "n/a: walk_cache declined this model"

    take = taker(indices)

    def walk_check():
        current = _C.tensor_walk(model, True)
        assert _C.walk_matches(current, refs)
        take(current)

    def cached_check():
        assert _C.walk_unchanged(cache, model) is not None

    timed = {
        "fused_ema.lerp_": lambda: fused_ema.lerp_(ema, src, 1 - DECAY),
        # Every check, the plan, the version bumps and the references, but no kernel: a zero
        # weight leaves the EMA as it is without touching the data.
        "lerp_ weight 0": lambda: fused_ema.lerp_(ema, src, 0.0),
        # The kernel's memory traffic alone: the same elements as one tensor pair.
        "one flat tensor": lambda: fused_ema.lerp_([flat_ema], [flat_src], 1 - DECAY),
        "torch._foreach_lerp_": lambda: torch._foreach_lerp_(ema, src, 1 - DECAY),
        "ModelEma.update": lambda: ema_model.update(model),
        CACHED_CHECK: cached_check,
        "full C walk check": walk_check,
        "Python tensor_walk": lambda: tensor_walk(model, True),
    }
    return {k: fn for k, fn in timed.items() if k not in unavailable}, unavailable


def repeated(fn, times: int):
    def run():
        for _ in range(times):
            fn()

    return run


def cpu_interleaved(steps: dict, rounds: int, reps: int, on_round) -> dict[str, list[float]]:
    """timing.interleaved's rotation (warm-up, then rounds starting from a different contender),
    timed with the calling thread's CPU clock."""
    names = list(steps)
    for fn in steps.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(reps):
                start = time.thread_time()
                steps[name]()
                samples[name].append(time.thread_time() - start)
        on_round()
    return samples


def measure(tensors: int, rounds: int, reps: int, on_round) -> dict:
    model = build_model(tensors)
    count = sum(1 for _ in model.parameters())
    inner = max(1, 4_000 // count)  # calls per sample: keeps timer overhead out of tiny calls
    calls, unavailable = steps(model)
    timed = {name: repeated(fn, inner) for name, fn in calls.items()}
    with torch.no_grad():  # as ModelEma.update runs (foreach would record the model's grads)
        samples = cpu_interleaved(timed, rounds, reps, on_round)
    row = {"tensors": count, "calls_per_sample": inner}
    for name in CONTENDERS:
        if name in unavailable:
            row[name] = {"status": unavailable[name]}
            continue
        stats = {"status": "ok", **summary([t / inner for t in samples[name]])}
        stats["ns_per_tensor"] = stats["median_ms"] * 1e6 / count
        row[name] = stats
    row["update_over_lerp"] = row[RATIO[0]]["median_ms"] / row[RATIO[1]]["median_ms"]
    return row


def cell(stats: dict, width: int = 0) -> str:
    """A contender's ns per tensor, or n/a."""
    spec = str(width) if width else ""
    if "ns_per_tensor" not in stats:
        return f"{'n/a':>{spec}}"
    return f"{stats['ns_per_tensor']:{spec}.1f}"


def not_measured(record: dict) -> list[str]:
    """One line per contender left out of some row, with why."""
    reasons = {}
    for row in record["rows"]:
        for name in CONTENDERS:
            if row[name]["status"] != "ok":
                reasons.setdefault(name, row[name]["status"])
    return [f"{name}: {reason}" for name, reason in reasons.items()]


def table(record: dict) -> str:
    header = f"{'tensors':>8} " + " ".join(f"{name:>20}" for name in CONTENDERS)
    header += f" {'update / lerp_':>15}"
    lines = ["median ns (thread CPU time) per model tensor", header, "-" * len(header)]
    for row in record["rows"]:
        cells = " ".join(cell(row[name], 20) for name in CONTENDERS)
        lines.append(f"{row['tensors']:8d} {cells} {row['update_over_lerp']:14.2f}x")
    return "\n".join(lines + not_measured(record))


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        f"# fused_ema host overhead: {m['cpu']}",
        "",
        f"{m['date']}, torch {m['torch']}, {m['threads']} CPU threads, Python {m['python']}, "
        f"fused_ema {m['fused_ema']['version']}. Median ns per model tensor (blocks of "
        f"Linear(4, 4) + LayerNorm(4), float32, CPU), thread CPU time, {record['rounds']} "
        "interleaved rounds.",
        "",
        "| tensors | " + " | ".join(CONTENDERS) + " | update / lerp_ |",
        "|---:|" + "---:|" * (len(CONTENDERS) + 1),
    ]
    for row in record["rows"]:
        cells = " | ".join(cell(row[name]) for name in CONTENDERS)
        lines.append(f"| {row['tensors']:,} | {cells} | {row['update_over_lerp']:.2f}x |")
    notes = not_measured(record)
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="100,1000,3000,10000", help="model tensors, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's own)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.threads:
        torch.set_num_threads(args.threads)
    record = {"machine": report.machine(["cpu"]), "rounds": args.rounds, "rows": []}
    with tqdm(total=len(sizes) * args.rounds, desc="overhead", unit="round", leave=False) as bar:
        for size in sizes:
            record["rows"].append(measure(size, args.rounds, args.reps, lambda: bar.update(1)))
    print(table(record))
    args.out.mkdir(parents=True, exist_ok=True)
    m = record["machine"]
    # One file per Python and torch: the walk cache and the host cost differ between them.
    python = ".".join(m["python"].split(".")[:2])
    torch_version = ".".join(m["torch"].split("+")[0].split(".")[:2])
    stem = f"overhead_{report.slug(m)}_py{python}-torch{torch_version}"
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(record))
    print(f"wrote {args.out / stem}.json and .md")
    return record


if __name__ == "__main__":
    main()
