"""When PostHocEma snapshots its EMAs, where to, and their numbering: the folder checks (a fresh
run never overwrites another's snapshots; a resumed one continues its numbering), the tensors and
metadata of each file (snapshots.py's format), handed to the background writer (writer.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from .snapshots import clean_temporary_files, next_index, snapshot_metadata, snapshot_path
from .writer import SnapshotWriter


class Snapshots:
    def __init__(self, folder, every: int, dtype: torch.dtype | None):
        self.folder = None if folder is None else Path(folder)
        self.every = every
        self.dtype = dtype
        self.next_index = 0  # the index of the next snapshot
        self.resumed = False  # restored from a checkpoint: may replace later snapshots
        self._init_transient()

    def _init_transient(self) -> None:
        self.writer = SnapshotWriter()
        self.checked = False  # the folder has been checked for another run's snapshots

    def due(self, t: int | None) -> bool:
        """Whether the update count `t` (None: not known yet) takes a snapshot."""
        return self.folder is not None and t is not None and t > 0 and t % self.every == 0

    def restore(self, index: int) -> None:
        """The numbering of a run resumed from a checkpoint taken before snapshot `index`."""
        self.next_index, self.resumed, self.checked = index, True, False

    def check_folder(self) -> None:
        """A fresh PostHocEma never overwrites another run's snapshots (checked by the rank that
        writes them: the others may already see its files)."""
        if self.checked or not writing_rank():
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        clean_temporary_files(self.folder)  # left by a writer killed mid-write
        found = next_index(self.folder)
        if found > self.next_index and not self.resumed:
            raise RuntimeError(
                f"fused_ema.PostHocEma: {str(self.folder)!r} already holds {found} snapshots "
                "of another run; pass an empty snapshot_dir, or load this run's checkpoint "
                "(load_state_dict) to continue its numbering"
            )
        self.checked = True

    def take(self, tracks, gammas, sigma_rels, t: int, wait_for) -> None:
        """Snapshot `next_index` of every track at update count `t`; `wait_for` is a non_blocking
        update still writing them (its future)."""
        index = self.next_index
        self.next_index += 1
        jobs = []
        for k, track in enumerate(tracks):
            tensors = snapshot_tensors(track)
            if tensors is None:
                continue  # another rank writes
            entries = track._binding.table.entries
            copied = [
                n for e in entries if not e.average for n in e.names if e.ema.is_floating_point()
            ]
            metadata = snapshot_metadata(
                step=t,
                gamma=gammas[k],
                sigma_rel=sigma_rels[k],
                index=index,
                ema_index=k,
                names=list(tensors),
                dtypes={n: v.dtype for n, v in tensors.items()},
                copied=copied,
            )
            jobs.append((snapshot_path(self.folder, index, k), tensors, metadata, self.dtype))
        if jobs:
            self.writer.submit(jobs, wait_for)

    def __getstate__(self) -> dict:
        self.writer.flush()
        return {k: v for k, v in self.__dict__.items() if k not in ("writer", "checked")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_transient()


def snapshot_tensors(track) -> dict | None:
    """The EMA's tensors by name for a snapshot, or None on a rank that does not write."""
    sharded = track._binding.policy.shard is not None
    if sharded:
        full = track.full_state_dict(rank=0, cpu_offload=False)
        return full or None
    if not writing_rank():
        return None
    out = {}
    for entry in track._binding.table.entries:
        for name in entry.names:
            out[name] = entry.ema.detach()
    return out


def writing_rank() -> bool:
    """Under torch.distributed, rank 0 writes the snapshots (every rank holds the same EMAs)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
