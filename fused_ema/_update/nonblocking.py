"""What a non_blocking update needs beyond its plan: side streams for the copies out of the GPU,
ordered against the training stream, and the job for the CPU half, run by fused_ema's update
worker with autograd off (grad mode is per thread: the caller's no_grad does not reach it). The
job's error is kept and raised by wait(). Dropped (not copied) by deepcopy and pickling."""

from __future__ import annotations

import torch

from .._ext.worker import UPDATES, Job
from .plan import copy_pairs


class AsyncRunner:
    def __init__(self):
        self._pending: Job | None = None
        self.started = None  # whether the update of the job in flight has written anything
        self._side_streams: dict = {}

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def issue_copies(self, pairs) -> list:
        """Starts the copies into staging: CPU sources at once, GPU sources on a side stream that
        first waits for the training stream; the training stream then waits for the copies, so
        no later kernel (the next optimizer step) writes a weight before it has been read."""
        events, by_device = [], {}  # None: the CPU sources
        for view, src in pairs:
            device = src.device if src.device.type == "cuda" else None
            by_device.setdefault(device, []).append((view, src))
        copy_pairs(by_device.pop(None, []))
        for device, device_pairs in by_device.items():
            current = torch.cuda.current_stream(device)
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                copy_pairs(device_pairs, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            current.wait_event(done)
            events.append(done)
        return events

    def job(self) -> Job | None:
        """The job in flight, for another thread to wait on (its error stays for wait())."""
        return self._pending

    def prepare(self, fn, started) -> None:
        """Makes `fn` the job in flight, not yet handed to the worker (launch() does), of an
        update for which `started()` tells whether anything is written."""
        self._pending, self.started = Job(fn), started

    def launch(self) -> None:
        UPDATES.put(self._pending)

    def settle(self) -> None:
        """After a call that prepared a job raised, before it decides whether its update
        happened: a job the worker has not begun is run here if started() (part of the update
        is written, so it must finish) or dropped; one the worker has begun is waited for."""
        job = self._pending
        if job.claim():
            if self.started():
                job.run()
            else:
                job.drop("its update was interrupted before it was handed over")
        else:
            job.wait()
        self._pending = self.started = None

    def wait(self) -> None:
        """Waits for the job in flight (busy); raises the error it ended with. Interrupted while
        waiting, the job stays in flight."""
        error = self._pending.wait()
        self._pending = self.started = None
        if error is not None:
            raise error
