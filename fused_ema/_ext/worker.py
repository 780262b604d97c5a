"""Background threads for deferred work (a non_blocking update's CPU half, PostHocEma's snapshot
writes), handed over by single C calls (a queue put, a lock acquire or release), never through
concurrent.futures, whose Condition an interrupt can leave half-released (docs/guarantees.md).
A job runs at most once: the worker or a caller settling an interrupted hand-off claims it."""

from __future__ import annotations

import _thread
import atexit
import os
import queue
import threading

from .grad import without_grad


class Dropped(RuntimeError):
    """The error of a job taken back before it ran (the call that made it failed)."""


class Job:
    __slots__ = ("_fn", "_claim", "_done", "_finished", "error")

    def __init__(self, fn):
        self._fn = fn
        self.error: BaseException | None = None
        self._finished = False
        self._claim = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()  # held until the job has run or been dropped

    def claim(self) -> bool:
        """Whether this call took the job: no one else runs or drops it."""
        return self._claim.acquire(False)

    def run(self) -> None:
        """Runs a claimed job with autograd off, keeping its error for the waiters."""
        try:
            without_grad(self._fn)
        except BaseException as error:  # noqa: BLE001 - kept for wait(), raised there
            self.error = error
        finally:
            self._fn, self._finished = None, True
            self._done.release()

    def drop(self, why: str) -> None:
        """Ends a claimed job without running it."""
        self.error, self._fn, self._finished = Dropped(why), None, True
        self._done.release()

    def done(self) -> bool:
        return self._finished  # (not _done.locked(): a waiter holds it for a moment)

    def wait(self) -> BaseException | None:
        """Blocks until the job has run or been dropped; returns its error. An interrupt while
        blocked leaves the job as it was (a lock's `with` releases on the way out)."""
        with self._done:
            pass
        return self.error


class Worker:
    """A daemon thread running the jobs of a FIFO queue, started at the first put() with
    _thread.start_new_thread: one C call, where threading.Thread.start waits on a Condition that
    an interrupt can break. An interrupt right after that call can make a second thread on the
    same queue later, which claims keep harmless. Restarted in a forked child, drained at exit."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False

    def put(self, job: Job) -> None:
        if not self._started:
            _thread.start_new_thread(_serve, (self._queue,))
            self._started = True
        self._queue.put(job)

    def drain(self) -> None:
        """Waits for every job queued so far (at exit: daemon threads are not joined)."""
        if self._started:
            marker = Job(lambda: None)
            self._queue.put(marker)
            marker.wait()

    def forget(self) -> None:
        """In a forked child: the parent's thread is not there."""
        self._queue, self._started = queue.SimpleQueue(), False


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job.claim():
            job.run()


UPDATES = Worker()  # the CPU halves of non_blocking updates
SNAPSHOTS = Worker()  # PostHocEma's snapshot files (their disk time apart from the updates)

for _worker in (SNAPSHOTS, UPDATES):  # (atexit runs last registered first: updates drained first)
    atexit.register(_worker.drain)
    os.register_at_fork(after_in_child=_worker.forget)
