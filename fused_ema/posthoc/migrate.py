"""ema-pytorch's PostHocEMA folders as snapshots: its files `{ema_index}.{step}.pt` (torch.save of
KarrasEMA.state_dict(): initted, step, ema_model.<name>, all cast to checkpoint_dtype) listed and
opened like fused_ema's own, so synthesize reads both. What they lack (the tracked sigma_rels, the
dtypes, EDM2's time) the caller supplies or a convention fills in, as docs/posthoc.md says."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from .profiles import gamma_to_sigma_rel, sigma_rel_to_gamma
from .snapshots import EMA_PYTORCH_NAME as NAME
from .snapshots import SnapshotContents, SnapshotError, SnapshotInfo

SOURCE = "ema-pytorch"
PREFIX = "ema_model."
DTYPE = torch.float32  # of every synthesized tensor: the files cast all, integer buffers too


def list_ema_pytorch_snapshots(
    folder, *, sigma_rels: Sequence[float] | None = None, gammas: Sequence[float] | None = None
) -> list[SnapshotInfo]:
    """The checkpoints of an ema-pytorch PostHocEMA folder as snapshots, given the sigma_rels (or
    gammas) the PostHocEMA was built with, in its order (its files do not record them). index is
    the rank of the file's step among the folder's steps."""
    if (sigma_rels is None) == (gammas is None):
        raise ValueError(
            "an ema-pytorch folder needs the sigma_rels or the gammas (one of them) its "
            "PostHocEMA was built with, in order: its files do not record them"
        )
    if sigma_rels is not None:
        sigma_rels = [float(s) for s in sigma_rels]
        gammas = [sigma_rel_to_gamma(s) for s in sigma_rels]
    else:
        gammas = [float(g) for g in gammas]
        sigma_rels = [gamma_to_sigma_rel(g) for g in gammas]
    folder = Path(folder)
    found = sorted(
        (int(m[2]), int(m[1]), folder / e.name)
        for e in os.scandir(folder)
        if (m := NAME.match(e.name))
    )
    rank = {step: i for i, step in enumerate(sorted({step for step, _, _ in found}))}
    snapshots = []
    for step, k, path in found:
        if k >= len(gammas):
            raise SnapshotError(
                f"{path}: a checkpoint of EMA {k}, but {len(gammas)} sigma_rels/gammas were given"
            )
        if step < 1:
            raise SnapshotError(f"{path}: step 0 (no update yet) cannot be synthesized from")
        snapshots.append(SnapshotInfo(rank[step], k, step, gammas[k], sigma_rels[k], path, SOURCE))
    held = {k for _, k, _ in found}
    if found and len(held) < len(gammas):  # ema-pytorch saves every EMA at each checkpoint
        raise SnapshotError(
            f"{folder} holds checkpoints of {len(held)} EMAs, but {len(gammas)} sigma_rels/gammas "
            "were given: give those its PostHocEMA was built with, in order"
        )
    return sorted(snapshots)


@contextmanager
def open_ema_pytorch_snapshot(info: SnapshotInfo) -> Iterator[SnapshotContents]:
    """The EMA's tensors of one ema-pytorch checkpoint (memory-mapped while the context lasts)."""
    try:
        state = torch.load(info.path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch.load raises many kinds for a damaged file
        raise SnapshotError(f"{info.path}: not a readable ema-pytorch checkpoint ({err})") from None
    items = state.items() if isinstance(state, dict) else ()
    tensors = {k[len(PREFIX) :]: v for k, v in items if str(k).startswith(PREFIX)}
    if not tensors:
        raise SnapshotError(
            f"{info.path}: not an ema-pytorch KarrasEMA state dict (no {PREFIX}* entries)"
        )
    wrong = [name for name, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if wrong:
        raise SnapshotError(f"{info.path}: entries that are not tensors: {', '.join(wrong)}")
    yield SnapshotContents(
        list(tensors),
        dict.fromkeys(tensors, DTYPE),
        {name: tuple(t.shape) for name, t in tensors.items()},
        frozenset(tensors),
        tensors.__getitem__,
    )
