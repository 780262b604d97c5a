"""What a non_blocking update needs beyond its plan: side streams for the copies out of the GPU,
ordered against the training stream, and one worker thread for the CPU half, whose jobs run with
autograd off (grad mode is per thread: the caller's no_grad does not reach it). The worker's error
is kept and raised by wait(). Dropped (not copied) by deepcopy and pickling."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .._ext.grad import without_grad


class AsyncRunner:
    def __init__(self):
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._side_streams: dict = {}

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def issue_copies(self, pairs) -> list:
        """Starts the copies into staging: CPU sources at once, GPU sources on a side stream that
        first waits for the training stream; the training stream then waits for the copies, so
        no later kernel (the next optimizer step) writes a weight before it has been read."""
        events, by_device = [], {}
        for view, src in pairs:
            if src.device.type == "cuda":
                by_device.setdefault(src.device, []).append((view, src))
            else:
                view.copy_(src)
        for device, device_pairs in by_device.items():
            current = torch.cuda.current_stream(device)
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for view, src in device_pairs:
                    view.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            current.wait_event(done)
            events.append(done)
        return events

    def job(self) -> Future | None:
        """The job in flight, for another thread to wait on (its error stays for wait())."""
        return self._pending

    def submit(self, fn) -> None:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused_ema")
        self._pending = self._worker.submit(without_grad, fn)

    def wait(self) -> None:
        """Waits for the job in flight; raises the error it ended with."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
