"""In-process calls bounded in time and in memory, from any thread, with no signal.

BFCL's stateful API classes (file system, trading, travel, ...) must run in
the trainer's process: their instances are the episode's state, which the
reward reads at the end. Their methods are pure Python, but a reply can still
make one call run long or grow memory fast: `cp` shares sub-directories
between copies, so a few hundred calls build a tree whose `find()` lists
billions of paths (3.5 GB of resident memory in the 5 s a call was allowed,
before this bound).

A call runs on a runner thread that only runs calls; the caller waits for it
and watches the clock and the process's resident memory (/proc/self/statm,
read every `POLL_S`). Past either bound it raises an exception in the runner
thread (CPython's `PyThreadState_SetAsyncExc`: delivered between bytecodes,
as a signal handler's exception would be) and the call unwinds there. No
signal and no timer of the process is used, so the bound holds whichever
thread drives the episode and never cancels a timer of the caller's. A call
that does not stop (stuck in one long native operation, or swallowing the
exception) is abandoned after `STOP_GRACE_S`: its runner is retired and the
next call gets a new one; the caller learns that the call's instances may
still be changing (`WorkerOutcome.WORKER_FAILED`).

What became of a call is a `WorkerOutcome`, as for the bounded worker
process: the executor words both the same way.
"""
from __future__ import annotations

import ctypes
import gc
import os
import queue
import threading
import time
from typing import Any, Callable

from rcgrpo.envs.bounded_worker import WorkerOutcome

# How much a single call may grow the process's resident memory. A real
# BFCL call allocates kilobytes; the bound is far from that and far below
# what a trainer can spare.
CALL_MEMORY_BUDGET_BYTES = 256 << 20
POLL_S = 0.005
# After the stop is raised: how long the call may take to unwind, and how
# often the stop is raised again (API code may catch and carry on).
STOP_GRACE_S = 5.0
RESTOP_EVERY_S = 0.5

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc  # (thread id, exception type, or NULL to clear)
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory, or None where /proc does not tell."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


class _Stop(BaseException):
    """Raised in the runner thread to end a call. A BaseException, so the
    `except Exception` of API code does not swallow it."""

    kind = ""


class _TimeUp(_Stop):
    kind = WorkerOutcome.TIMED_OUT


class _OverMemory(_Stop):
    kind = WorkerOutcome.EXHAUSTED


class _Job:
    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.done = threading.Event()
        self.outcome: WorkerOutcome | None = None
        self.running = False


class _Runner:
    """One thread that runs jobs, one at a time."""

    def __init__(self):
        # Guards `job.running` against a stop raised as the job finishes:
        # a stop is raised only while its job runs, and finishing clears any
        # stop still pending, so none can reach the runner's next job.
        self.state = threading.Lock()
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.current: _Job | None = None
        self.thread = threading.Thread(target=self._loop, name="rcgrpo-env-call", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                job = self.current = self.jobs.get()
                if job is None:
                    return  # retired
                with self.state:
                    job.running = True
                try:
                    outcome = WorkerOutcome(WorkerOutcome.RETURNED, job.fn())
                except _Stop as stop:
                    outcome = WorkerOutcome(stop.kind)
                except MemoryError as exc:
                    outcome = WorkerOutcome(WorkerOutcome.EXHAUSTED, f"out of memory {exc}".strip())
                except BaseException as exc:  # SystemExit too: nothing a call raises may end the runner
                    outcome = WorkerOutcome(WorkerOutcome.RAISED, str(exc))
                self._finish(job, outcome)
            except _Stop as stop:  # raised just as its job finished: the job ends stopped
                if self.current is not None:
                    self._finish(self.current, WorkerOutcome(stop.kind))

    def _finish(self, job: _Job, outcome: WorkerOutcome) -> None:
        with self.state:
            if job.running:
                job.running = False
                job.outcome = outcome
                _set_async_exc(ctypes.c_ulong(self.thread.ident), None)  # a stop still pending is for this job only
                job.done.set()

    def stop(self, job: _Job, stop: type[_Stop]) -> None:
        with self.state:
            if job.running:
                _set_async_exc(ctypes.c_ulong(self.thread.ident), ctypes.py_object(stop))

    def retire(self) -> None:
        self.jobs.put(None)


class BoundedThread:
    """Caller side: one runner per process (`shared`), one call at a time."""

    _shared: "BoundedThread | None" = None
    _shared_lock = threading.Lock()

    def __init__(self):
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._runner: _Runner | None = None

    @classmethod
    def shared(cls) -> "BoundedThread":
        with cls._shared_lock:
            if cls._shared is None or cls._shared._owner != os.getpid():  # threads do not survive fork
                cls._shared = cls()
            return cls._shared

    def run(self, fn: Callable[[], Any], timeout_s: float,
            memory_budget_bytes: int = CALL_MEMORY_BUDGET_BYTES) -> WorkerOutcome:
        """The outcome of `fn()`, stopped past `timeout_s` seconds or past
        `memory_budget_bytes` of growth in resident memory."""
        with self._lock:
            if self._runner is None or not self._runner.thread.is_alive():
                self._runner = _Runner()
            runner, job = self._runner, _Job(fn)
            start_rss = resident_bytes()
            deadline = time.monotonic() + timeout_s
            runner.jobs.put(job)
            stopped_at = None
            while not job.done.wait(POLL_S):
                now = time.monotonic()
                if stopped_at is None:
                    rss = resident_bytes() if start_rss is not None else None
                    if now >= deadline:
                        stop = _TimeUp
                    elif rss is not None and rss - start_rss > memory_budget_bytes:
                        stop = _OverMemory
                    else:
                        continue
                    stopped_at, last_stop = now, now
                    runner.stop(job, stop)
                elif now - stopped_at > STOP_GRACE_S:
                    # It does not stop: leave it to finish on its own thread.
                    runner.retire()
                    self._runner = None
                    return WorkerOutcome(WorkerOutcome.WORKER_FAILED,
                                         f"the call did not stop within {STOP_GRACE_S:g} s of its "
                                         f"{'time' if stop is _TimeUp else 'memory'} bound")
                elif now - last_stop > RESTOP_EVERY_S:
                    last_stop = now
                    runner.stop(job, stop)
            outcome = job.outcome
            if outcome.kind in (WorkerOutcome.TIMED_OUT, WorkerOutcome.EXHAUSTED):
                # What a stopped call built is held by reference cycles of its
                # frames (API closures that call themselves, as `find` does):
                # free it now, not whenever the collector would next run.
                gc.collect()
            if outcome.kind == WorkerOutcome.EXHAUSTED and outcome.detail is None:
                outcome = WorkerOutcome(WorkerOutcome.EXHAUSTED,
                                        f"call exceeded the {memory_budget_bytes >> 20} MiB memory bound")
            return outcome
