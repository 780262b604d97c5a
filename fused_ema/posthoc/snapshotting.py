"""When PostHocEma snapshots its EMAs, where to, and how: the folder checks (a fresh run never
overwrites another's snapshots; a resumed one continues its numbering), then each snapshot staged
into host tensors of the snapshot dtype and written by the snapshot worker, a crash-safe file per
tracked EMA. An update waits only for the staging; a worker's error is raised by the next call."""

from __future__ import annotations

from pathlib import Path

import torch

from .._ext.worker import SNAPSHOTS, Dropped, Job
from .snapshots import (
    clean_temporary_files,
    next_index,
    snapshot_metadata,
    snapshot_path,
    snapshot_tensors,
    write_snapshot,
)


class Snapshots:
    def __init__(self, folder, every: int, dtype: torch.dtype | None):
        self.folder = None if folder is None else Path(folder)
        self.every = every
        self.dtype = dtype
        self.next_index = 0  # the index of the next snapshot
        self.resumed = False  # restored from a checkpoint: may replace later snapshots
        self._init_transient()

    def _init_transient(self) -> None:
        self.checked = False  # the folder has been checked for another run's snapshots
        self._staging: Job | None = None  # the last snapshot's staging: wait_staged() waits
        self._written: list[Job] = []

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

    def take(self, tracks, gammas, sigma_rels, t: int, wait_for: Job | None) -> None:
        """Snapshot `next_index` of every track at update count `t`, its tensors staged first:
        CUDA ones copied now into pinned memory in stream order, CPU ones on the worker once
        `wait_for` (a non_blocking update still writing them) is done. Two jobs of the snapshot
        worker, in order: the staging, then the files."""
        index = self.next_index
        self.next_index += 1
        taken = []
        for k, track in enumerate(tracks):
            tensors = ema_tensors(track)
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
            taken.append((snapshot_path(self.folder, index, k), tensors, metadata))
        if not taken:
            return
        self.raise_failure()
        self.wait_staged()
        files, events = [], []
        for path, tensors, metadata in taken:
            pinned, on_cpu = {}, {}  # the CPU tensors are staged on the worker
            for name, tensor in tensors.items():
                if tensor.device.type == "cuda":
                    pinned[name] = _pinned_copy(tensor, self.dtype)
                    events.append(torch.cuda.Event())
                    events[-1].record(torch.cuda.current_stream(tensor.device))
                else:
                    on_cpu[name] = tensor
            files.append((path, pinned, on_cpu, metadata))
        host: list = []
        stage = Job(lambda: _stage(files, self.dtype, wait_for, host))
        write = Job(lambda: _write(stage, events, host))
        try:
            self._staging = stage
            self._written.append(write)
            SNAPSHOTS.put(stage)
            SNAPSHOTS.put(write)
        except BaseException:
            # Interrupted: what the worker has not begun is taken back (a dropped staging makes
            # its write a no-op), so no staging is left that nobody will run.
            for job in (stage, write):
                if job.claim():
                    job.drop("the call that took this snapshot was interrupted")
            raise

    def wait_staged(self) -> None:
        """Before the EMA changes: the last snapshot's tensors have been copied out of it."""
        if self._staging is not None:
            self._staging.wait()

    def flush(self) -> None:
        """Waits until every snapshot taken is on disk; raises the first failure."""
        for job in self._written:
            job.wait()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raises the error of a snapshot that could not be written (once), dropping those done."""
        done = [j for j in self._written if j.done()]
        self._written = [j for j in self._written if not j.done()]
        for job in done:
            if job.error is not None:
                raise RuntimeError(
                    f"fused_ema: a PostHocEma snapshot was not written: {job.error}"
                ) from job.error

    def __getstate__(self) -> dict:
        self.flush()
        transient = ("checked", "_staging", "_written")
        return {k: v for k, v in self.__dict__.items() if k not in transient}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_transient()


def ema_tensors(track) -> dict | None:
    """The EMA's tensors by name for a snapshot, or None on a rank that does not write."""
    if track._binding.policy.shard is not None:
        return track.full_state_dict(rank=0, cpu_offload=False) or None
    if not writing_rank():
        return None
    return {name: e.ema.detach() for e in track._binding.table.entries for name in e.names}


def writing_rank() -> bool:
    """Under torch.distributed, rank 0 writes the snapshots (every rank holds the same EMAs)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _stage(files: list, dtype, wait_for: Job | None, host: list) -> None:
    """On the worker: the snapshot's CPU tensors copied out of the EMA into `host`, unless the
    update they come from failed (it wrote nothing; its error reaches the caller)."""
    if wait_for is not None and wait_for.wait() is not None:
        return
    for path, pinned, on_cpu, metadata in files:
        host.append((path, {**pinned, **snapshot_tensors(on_cpu, dtype)}, metadata))


def _write(stage: Job, events: list, host: list) -> None:
    if stage.wait() is not None:  # (run before it, unless a second thread took it)
        if isinstance(stage.error, Dropped):
            return  # the call that took the snapshot was interrupted: nothing to write
        raise stage.error
    for event in events:
        event.synchronize()
    for path, tensors, metadata in host:
        write_snapshot(path, tensors, metadata)


def _pinned_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    out = torch.empty(tensor.shape, dtype=target, pin_memory=True)
    return out.copy_(tensor.detach(), non_blocking=True)
