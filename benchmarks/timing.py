"""Timing on shared, noisy machines: contenders interleaved round by round (the order rotating),
warmed up, repeated; medians and quartiles; the machine's copy bandwidth measured in the same run
as the yardstick for a memory-bound update."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronizer(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def time_once(
    fn: Callable[[], None], sync: Callable[[], None], prepare: Callable[[], None] | None = None
) -> float:
    if prepare is not None:
        prepare()  # untimed: puts the machine in the state the call is meant to start from
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def interleaved(
    steps: dict[str, Callable[[], None]],
    rounds: int,
    reps: int,
    sync: Callable[[], None],
    on_round: Callable[[], None] = lambda: None,
    budget_s: float = 0.5,
    prepare: dict[str, Callable[[], None]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each step, measured in rounds; each round runs every contender up to
    `reps` times (fewer for one slower than `budget_s` a round, at least once), starting from a
    different contender each round, so drift in the machine's load spreads evenly."""
    names = list(steps)
    prepare = prepare or {}
    samples: dict[str, list[float]] = {name: [] for name in names}
    per_round = {}
    for name in names:  # warm-up: first-call costs stay out of the numbers
        first = time_once(steps[name], sync, prepare.get(name))
        per_round[name] = max(1, min(reps, int(budget_s / max(first, 1e-9))))
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            for _ in range(per_round[name]):
                samples[name].append(time_once(steps[name], sync, prepare.get(name)))
        on_round()
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p25_ms": q[0] * 1e3,
        "p75_ms": q[2] * 1e3,
        "min_ms": ordered[0] * 1e3,
        "samples": len(ordered),
    }


def copy_bandwidth(device: str, megabytes: int = 512, reps: int = 7) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    numel = megabytes * 2**20 // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    sync = synchronizer(device)
    times = [time_once(lambda: dst.copy_(src), sync) for _ in range(reps)]
    return 2 * numel * 4 / statistics.median(times) / 1e9
