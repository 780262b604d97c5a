"""PostHocEma's snapshots, written off the training thread: each snapshot's EMA tensors are
staged (copied out of the EMA into host tensors of the snapshot dtype) and then written by one
worker thread, one crash-safe file per tracked EMA (snapshots.write_snapshot). The next update
waits only for the staging, never for the disk; an error of the worker is raised by the next
call."""

from __future__ import annotations

import torch

from .._ext.worker import SNAPSHOTS, Dropped, Job
from .snapshots import write_snapshot


class SnapshotWriter:
    def __init__(self):
        self._staging: Job | None = None  # the last snapshot's staging: wait_staged() waits for it
        self._written: list[Job] = []

    def submit(self, jobs: list, wait_for: Job | None) -> None:
        """Writes each (path, tensors, metadata) of `jobs`, its tensors staged first: CUDA ones
        copied now into pinned memory in stream order, CPU ones on the worker once `wait_for`
        (a non_blocking update still writing them) is done. Two jobs of the snapshot worker, in
        order: the staging, then the files."""
        self.raise_failure()
        self.wait_staged()
        staged = []
        events = []
        for path, tensors, metadata, dtype in jobs:
            out = {}
            for name, tensor in tensors.items():
                if tensor.device.type == "cuda":
                    out[name] = (_pinned_copy(tensor, dtype), False)
                    events.append(_recorded(tensor.device))
                else:
                    out[name] = (tensor, True)  # staged on the worker
            staged.append((path, out, metadata, dtype))
        host: list = []
        stage = Job(lambda: _stage(staged, wait_for, host))
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
        """Waits until every snapshot submitted is on disk; raises the first failure."""
        for job in self._written:
            job.wait()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raises the error of a snapshot that could not be written (once), dropping those done."""
        done = [j for j in self._written if j.done()]
        self._written = [j for j in self._written if not j.done()]
        for job in done:
            error = job.error
            if error is not None:
                raise RuntimeError(
                    f"fused_ema: a PostHocEma snapshot was not written: {error}"
                ) from error


def _stage(staged: list, wait_for: Job | None, host: list) -> None:
    """On the worker: the snapshot's tensors copied out of the EMA into `host`, unless the update
    they come from failed (it wrote nothing; its error reaches the caller)."""
    if wait_for is not None and wait_for.wait() is not None:
        return
    for path, tensors, metadata, dtype in staged:
        copies = {n: _host_copy(t, dtype) if copy else t for n, (t, copy) in tensors.items()}
        host.append((path, copies, metadata))


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
    out.copy_(tensor.detach(), non_blocking=True)
    return out


def _recorded(device: torch.device):
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _host_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(dtype=target, copy=True).contiguous()
