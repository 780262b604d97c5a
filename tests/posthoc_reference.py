"""Float64 reference of post-hoc EMA (EDM2, Karras et al. 2024), written from the paper rather than
from fused_ema.posthoc: gamma from sigma_rel by bisection, power-function EMAs tracked update by
update, profile inner products by Gauss-Legendre quadrature; and a simulated training run that
writes snapshots the way PostHocEma does (fused_ema.posthoc.save_snapshot)."""

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fused_ema.posthoc import save_snapshot

TRACKED = (0.05, 0.10)  # the sigma_rels of the EMAs a run tracks
TARGETS = (0.07, 0.15, 0.03)  # between and beyond them


def sigma_rel(gamma: float) -> float:
    """EDM2 eq. 123."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def gamma_of(s: float) -> float:
    """The gamma >= (sqrt(5)-3)/2 of width s, where sigma_rel(gamma) decreases: bisection."""
    lo, hi = (math.sqrt(5) - 3) / 2, 1.0
    while sigma_rel(hi) > s:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sigma_rel(mid) > s else (lo, mid)
    return (lo + hi) / 2


def beta(gamma: float, t: int) -> float:
    """EDM2 eq. 127 with time in updates: update t (from 1) decays by (1 - 1/t) ** (gamma + 1)."""
    return (1 - 1 / t) ** (gamma + 1)


NODES, WEIGHTS = np.polynomial.legendre.leggauss(96)


def inner_product(t_a, g_a, t_b, g_b) -> float:
    """The integral over [0, min(t_a, t_b)] of the two profiles (gamma+1)/t (s/t)**gamma."""
    x, w = NODES, WEIGHTS
    m = min(t_a, t_b)
    s = (x + 1) * m / 2
    f = (g_a + 1) / t_a * (s / t_a) ** g_a * (g_b + 1) / t_b * (s / t_b) ** g_b
    return float(np.sum(w * f) * m / 2)


def coefficients(steps, gammas, t, gamma) -> np.ndarray:
    """Least-squares coefficients of the snapshots' profiles for the target's, summing to 1."""
    n = len(steps)
    a = np.array([[inner_product(steps[i], gammas[i], steps[j], gammas[j]) for j in range(n)]
                  for i in range(n)])  # fmt: skip
    b = np.array([inner_product(steps[i], gammas[i], t, gamma) for i in range(n)])
    c = np.linalg.lstsq(a, b, rcond=None)[0]
    return c / c.sum()


# The model of the run: names as in a state dict, an integer buffer, and a float buffer the EMA
# copies from the model instead of averaging.
SHAPES = {"0.weight": (8, 16), "0.bias": (8,), "bn.running_mean": (8,), "bn.running_var": (8,)}
COPIED = ("bn.running_var",)
COUNTER = "bn.num_batches_tracked"


@dataclass
class Run:
    """A simulated run: the model's weights drift at random (fresh normal data each update, a slow
    trend, never zeros); power EMAs of every sigma_rel in `tracked` and `targets` are tracked in
    float64; snapshots of the tracked ones are written into each folder of `folders` (step between
    snapshots -> (folder, snapshot dtype)); truth[(sigma_rel, t)] is the directly tracked EMA at
    each t of `keep` and at the end, models[t] the weights then."""

    steps: int
    folders: dict
    keep: tuple = ()
    tracked: tuple = TRACKED
    targets: tuple = TARGETS
    seed: int = 0
    truth: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)

    def run(self) -> "Run":
        g = torch.Generator().manual_seed(self.seed)
        model = {n: 1 + torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}
        trend = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}
        emas = {s: None for s in self.tracked + self.targets}
        gammas = {s: gamma_of(s) for s in emas}
        index = dict.fromkeys(self.folders, 0)
        for t in range(1, self.steps + 1):
            for name in model:
                noise = torch.randn(SHAPES[name], generator=g, dtype=torch.float64)
                model[name] = model[name] + 0.03 * noise + 0.002 * trend[name]
            for s, ema in emas.items():
                b = beta(gammas[s], t)
                emas[s] = {
                    n: model[n].clone() if ema is None or n in COPIED else b * ema[n] + (1 - b) * x
                    for n, x in model.items()
                }
                emas[s][COUNTER] = torch.tensor(t)
            for every, (folder, dtype) in self.folders.items():
                if t % every == 0:
                    for k, s in enumerate(self.tracked):
                        save_snapshot(
                            folder,
                            emas[s],
                            index=index[every],
                            ema_index=k,
                            step=t,
                            gamma=gammas[s],
                            snapshot_dtype=dtype,
                            copied=COPIED,
                        )
                    index[every] += 1
            if t in self.keep or t == self.steps:
                for s in self.targets:
                    self.truth[(s, t)] = {n: x.clone() for n, x in emas[s].items()}
                self.models[t] = dict(model)
        return self


def relative_error(got: dict, truth: dict, model: dict) -> float:
    """||got - truth|| / ||truth - model|| over the averaged tensors: the error as a fraction of how
    far the EMA sits from the current weights."""
    names = [n for n in SHAPES if n not in COPIED]
    num = sum(float((got[n].double() - truth[n]).square().sum()) for n in names)
    den = sum(float((truth[n] - model[n]).square().sum()) for n in names)
    return math.sqrt(num / den)
