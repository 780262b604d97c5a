"""Post-hoc EMA synthesis: the EMA of any sigma_rel (or gamma) at a snapshot step (between snapshots
nothing records the updates since the last), the least-squares combination of the snapshots up to
it (profiles.py), summed in one streaming pass: one file open at a time, float64 sums. Reads
fused_ema's snapshot folders and ema-pytorch's (migrate.py), told apart by their file names."""

from __future__ import annotations

import bisect
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import migrate
from .profiles import (
    gamma_to_sigma_rel,
    least_squares_coefficients,
    power_profile,
    sigma_rel_to_gamma,
)
from .snapshots import SnapshotError, SnapshotInfo, list_snapshots, open_snapshot

OPENERS = {"fused_ema": open_snapshot, migrate.SOURCE: migrate.open_ema_pytorch_snapshot}


@dataclass(frozen=True)
class Synthesis:
    """How the EMA of `gamma` (`sigma_rel`) at `step` is made: sum_i coefficients[i] *
    snapshots[i] (the coefficients sum to 1), and fit_error = ||sum_i c_i p_i - p|| / ||p||, the
    relative L2 distance between the reconstructed averaging profile and the target's."""

    step: int
    gamma: float
    sigma_rel: float
    snapshots: tuple[SnapshotInfo, ...]
    coefficients: tuple[float, ...]
    fit_error: float

    def profiles(self, tau) -> tuple[torch.Tensor, torch.Tensor]:
        """(target, reconstructed) averaging profiles at times tau (float64): the weight per
        update that each gives to the parameters of update tau."""
        tau = torch.as_tensor(tau, dtype=torch.float64)
        target = power_profile(self.step, self.gamma, tau)
        reconstructed = torch.zeros_like(target)
        for info, c in zip(self.snapshots, self.coefficients):
            reconstructed += c * power_profile(info.step, info.gamma, tau)
        return target, reconstructed


def _check_history(snapshots: Sequence[SnapshotInfo]) -> None:
    """Each EMA's steps grow with the snapshot index; no two snapshots share step and gamma."""
    last: dict[int, SnapshotInfo] = {}
    seen: dict[tuple[int, float], SnapshotInfo] = {}
    for info in sorted(snapshots):
        before = last.get(info.ema_index)
        if before is not None and info.step <= before.step:
            raise SnapshotError(
                f"{info.path} (step {info.step}) follows {before.path} (step {before.step}): "
                "a run resumed from an earlier point wrote over a later one; remove the snapshots "
                "of the abandoned run"
            )
        other = seen.get((info.step, info.gamma))
        if other is not None:
            raise SnapshotError(f"{info.path} and {other.path}: the same gamma at the same step")
        last[info.ema_index] = seen[(info.step, info.gamma)] = info


def solve_coefficients(
    snapshot_dir,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    tracked_sigma_rels: Sequence[float] | None = None,
    tracked_gammas: Sequence[float] | None = None,
) -> Synthesis:
    """The Synthesis of the EMA of sigma_rel (or gamma) at `step` (default: the last snapshot's)
    from the snapshots at or before it, without reading any tensor. See synthesize."""
    if (sigma_rel is None) == (gamma is None):
        raise ValueError(
            "give exactly one of sigma_rel and gamma (got "
            f"{'both' if sigma_rel is not None else 'neither'})"
        )
    if sigma_rel is not None:
        gamma, sigma_rel = sigma_rel_to_gamma(sigma_rel), float(sigma_rel)  # checks sigma_rel
    else:
        sigma_rel, gamma = gamma_to_sigma_rel(gamma), float(gamma)  # checks gamma
    if not isinstance(snapshot_dir, (str, os.PathLike)):  # a list of SnapshotInfo
        snapshots = sorted(snapshot_dir)
    else:  # fused_ema's snapshots or ema-pytorch's checkpoints, told apart by their file names
        snapshots = list_snapshots(snapshot_dir)  # (FileNotFoundError if there is no such folder)
        if any(migrate.NAME.match(e.name) for e in os.scandir(snapshot_dir)):
            if snapshots:
                raise SnapshotError(
                    f"{snapshot_dir} holds both fused_ema snapshots and ema-pytorch checkpoints"
                )
            snapshots = migrate.list_ema_pytorch_snapshots(
                snapshot_dir, sigma_rels=tracked_sigma_rels, gammas=tracked_gammas
            )
        elif tracked_sigma_rels is not None or tracked_gammas is not None:
            raise ValueError(
                "tracked_sigma_rels / tracked_gammas are for ema-pytorch folders only: fused_ema "
                "snapshots record their own"
            )
    if not snapshots:
        raise SnapshotError(
            f"{snapshot_dir} holds no snapshots (files NNNNNN-emaK.safetensors, or ema-pytorch's "
            "K.STEP.pt)"
        )
    _check_history(snapshots)
    steps = sorted({info.step for info in snapshots})
    if step is None:
        step = steps[-1]
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    step = operator.index(step)
    if step not in steps:
        at = bisect.bisect(steps, step)
        near = ", ".join(str(s) for s in steps[max(at - 1, 0) : at + 1])
        raise ValueError(
            f"step {step} is not a snapshot step (the snapshots' steps run from {steps[0]} to "
            f"{steps[-1]}; nearest: {near}): the EMA can be synthesized at those only"
        )
    used = sorted((s for s in snapshots if s.step <= step), key=lambda s: (s.step, s.ema_index))
    coefficients, fit_error = least_squares_coefficients(
        [s.step for s in used], [s.gamma for s in used], step, gamma
    )
    return Synthesis(step, gamma, sigma_rel, tuple(used), tuple(coefficients.tolist()), fit_error)


def synthesize(
    snapshot_dir,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    tracked_sigma_rels: Sequence[float] | None = None,
    tracked_gammas: Sequence[float] | None = None,
) -> dict[str, torch.Tensor]:
    """The EMA of relative width sigma_rel (or exponent gamma: exactly one) after `step` updates
    (default: the last snapshot's step; it must be a snapshot step), by name, on the CPU.

    snapshot_dir: a folder of fused_ema snapshots, one of ema-pytorch PostHocEMA checkpoints (give
    tracked_sigma_rels or tracked_gammas, which its files lack), or a list of SnapshotInfo.
    Averaged (floating-point) tensors are the least-squares combination of the snapshots at or
    before `step`, summed in float64, returned in the EMA's own dtype (or `dtype`); the others
    (and those the EMA copies) come from the latest snapshot used. progress=True shows a tqdm bar
    over the files read."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    plan = solve_coefficients(
        snapshot_dir,
        sigma_rel=sigma_rel,
        gamma=gamma,
        step=step,
        tracked_sigma_rels=tracked_sigma_rels,
        tracked_gammas=tracked_gammas,
    )
    first, reference = plan.snapshots[0], None
    for info in plan.snapshots:  # headers only: mismatches before any sum
        with OPENERS[info.source](info) as latest:
            reference = reference or latest
        if latest.names != reference.names or latest.shapes != reference.shapes:
            names = set(latest.names) ^ set(reference.names) or {
                n for n in latest.names if latest.shapes[n] != reference.shapes.get(n)
            }
            raise SnapshotError(
                f"{info.path} and {first.path} hold different tensors (names or shapes differ: "
                f"{', '.join(sorted(names)[:5]) or 'their order'})"
            )
        if latest.averaged != reference.averaged:
            names = sorted(latest.averaged ^ reference.averaged)
            raise SnapshotError(
                f"{info.path} and {first.path}: averaged in one, copied in the other: "
                f"{', '.join(names[:5])}"
            )
    sums: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    files = zip(plan.snapshots, plan.coefficients)
    if progress:
        from tqdm import tqdm

        files = tqdm(files, total=len(plan.snapshots), desc="synthesizing", unit="file")
    for info, c in files:
        with OPENERS[info.source](info) as contents:
            for name in contents.names:
                if name in contents.averaged:
                    x = contents.get(name)  # (a new float64 tensor at the first file)
                    sums[name] = sums[name].add_(x, alpha=c) if name in sums else c * x.double()
                elif info is plan.snapshots[-1]:
                    out[name] = contents.get(name).clone()
    for name in latest.names:  # in the EMA's order, floating-point ones in its latest dtypes
        value = sums.pop(name) if name in sums else out.pop(name)
        out[name] = value.to(dtype or latest.dtypes[name]) if value.is_floating_point() else value
    return out
