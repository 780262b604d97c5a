"""PostHocEma's snapshots, written off the training thread: each snapshot's EMA tensors are
staged (copied out of the EMA into host tensors of the snapshot dtype) and then written by one
worker thread, one crash-safe file per tracked EMA (snapshots.write_snapshot). The next update
waits only for the staging, never for the disk; an error of the worker is raised by the next
call."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .._ext.grad import without_grad
from .snapshots import write_snapshot


class SnapshotWriter:
    def __init__(self):
        self._worker: ThreadPoolExecutor | None = None
        self._staged = threading.Event()
        self._staged.set()
        self._written: list[Future] = []

    def submit(self, jobs: list, wait_for: Future | None) -> None:
        """Writes each (path, tensors, metadata) of `jobs`, its tensors staged first: CUDA ones
        copied now into pinned memory in stream order, CPU ones on the worker once `wait_for`
        (a non_blocking update still writing them) is done."""
        self.raise_failure()
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
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused_ema_snap")
        self._staged.clear()
        try:
            future = self._worker.submit(without_grad, self._write, staged, events, wait_for)
        except BaseException:
            self._staged.set()
            raise
        self._written.append(future)

    def _write(self, staged: list, events: list, wait_for: Future | None) -> None:
        try:
            if wait_for is not None and wait_for.exception() is not None:
                return  # that update failed and wrote nothing: its error reaches the caller
            host = []
            for path, tensors, metadata, dtype in staged:
                copies = {
                    n: _host_copy(t, dtype) if copy else t for n, (t, copy) in tensors.items()
                }
                host.append((path, copies, metadata))
        finally:
            self._staged.set()
        for event in events:
            event.synchronize()
        for path, tensors, metadata in host:
            write_snapshot(path, tensors, metadata)

    def wait_staged(self) -> None:
        """Before the EMA changes: the last snapshot's tensors have been copied out of it."""
        self._staged.wait()

    def flush(self) -> None:
        """Waits until every snapshot submitted is on disk; raises the first failure."""
        for future in self._written:
            future.exception()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raises the error of a snapshot that could not be written (once), dropping those done."""
        done = [f for f in self._written if f.done()]
        self._written = [f for f in self._written if not f.done()]
        for future in done:
            error = future.exception()
            if error is not None:
                raise RuntimeError(
                    f"fused_ema: a PostHocEma snapshot was not written: {error}"
                ) from error

    def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)


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
