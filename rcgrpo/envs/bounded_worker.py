"""A worker process for what must not run unbounded in the trainer.

Two things run here, each in its own lazily started worker per process:
BFCL's stateless API classes (MathAPI), whose slow paths are single native
operations (`base**exponent` on big ints, mpmath at a huge `precision`) that
no signal can interrupt; and bfcl_eval's official checker, which executes the
model's calls again (MathAPI included) through `eval`. The parent kills a
worker whose request exceeds its time bound; the worker's address space is
capped (`MEMORY_LIMIT_BYTES`), so a request that would exhaust memory fails
there instead of in the trainer; and the process-wide numeric state a call
can set (mpmath's precision, the decimal context) is put back after every
request, so one call cannot slow down or change the text of the next. A
killed worker loses nothing: what runs here is stateless; the next request
starts a new one. Requests and replies are pickled over the child's
stdin/stdout: both ends are this module, and the payload holds only decoded
literals and the entry's own data.

The worker reports what became of a request (`WorkerOutcome`), unworded:
its callers (rcgrpo.envs.executor, rcgrpo.envs.reward) word it.
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

_HEADER = struct.Struct("!I")
STARTUP_TIMEOUT_S = 60.0
# The worker's address-space cap: the imports take ~1 GiB of it; a request
# past the rest gets MemoryError there and the worker is replaced.
MEMORY_LIMIT_BYTES = 3 << 30
_DIE_WITH_PARENT = "RCGRPO_WORKER_DIES_WITH_PARENT"


def _send(stream, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(stream, size: int) -> bytes:
    # Unbuffered pipes may return short reads.
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("worker pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(stream) -> Any:
    (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return pickle.loads(_read_exact(stream, size))


@dataclass(frozen=True)
class WorkerOutcome:
    """What became of one request sent to the worker."""

    RETURNED = "returned"  # detail: the return value (its str() if it cannot be pickled)
    RAISED = "raised"  # detail: the exception's text
    EXHAUSTED = "exhausted"  # it ran out of the worker's memory; detail: the error's text
    TIMED_OUT = "timed_out"  # the worker was killed at the time bound; detail None
    WORKER_FAILED = "worker_failed"  # the request never ran to an answer; detail: what broke

    kind: str
    detail: Any = None


class BoundedWorker:
    """Parent side: one worker per name and process (`shared`), serving one
    request at a time."""

    _shared: dict[str, "BoundedWorker"] = {}
    _shared_lock = threading.Lock()

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._owner = os.getpid()
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, name: str) -> "BoundedWorker":
        with cls._shared_lock:
            worker = cls._shared.get(name)
            if worker is None or worker._owner != os.getpid():  # a forked child starts its own
                worker = cls._shared[name] = cls()
            return worker

    @classmethod
    def kill_all(cls) -> None:
        with cls._shared_lock:
            for worker in cls._shared.values():
                worker.kill()

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # The kernel's parent-death signal follows the thread that
            # started the child: ask for it only from the main thread, which
            # lives as long as the process.
            main_thread = threading.current_thread() is threading.main_thread()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "rcgrpo.envs.bounded_worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                # unbuffered, so select() on the pipe sees every waiting byte
                env={**os.environ, _DIE_WITH_PARENT: "1" if main_thread else "0"},
            )
            # The worker says "ready" once its imports are done, so start-up
            # time never counts against a request's bound.
            ready, _, _ = select.select([self._proc.stdout], [], [], STARTUP_TIMEOUT_S)
            if not ready or _recv(self._proc.stdout) != "ready":
                self.kill()
                raise OSError("bounded worker did not start")
        return self._proc

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def run(self, module: str, function: str, kwargs: dict, timeout_s: float) -> WorkerOutcome:
        """The outcome of `module.function(**kwargs)` in the worker."""
        with self._lock:
            try:
                proc = self._start()
                _send(proc.stdin, (module, function, kwargs))
                ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
                if not ready:
                    self.kill()
                    return WorkerOutcome(WorkerOutcome.TIMED_OUT)
                kind, value = _recv(proc.stdout)
            except (EOFError, BrokenPipeError, OSError, pickle.UnpicklingError) as exc:
                self.kill()
                return WorkerOutcome(WorkerOutcome.WORKER_FAILED, str(exc))
            except BaseException:  # Ctrl-C (the worker ignores it) or any other way out: no orphan keeps computing
                self.kill()
                raise
            if kind == WorkerOutcome.EXHAUSTED:
                self.kill()  # a fresh worker, not one with a fragmented heap
        return WorkerOutcome(kind, value)


# ------------------------------------------------------------------ worker side
def _numeric_state():
    import decimal

    import mpmath

    return mpmath.mp.prec, decimal.getcontext().copy()


def _restore_numeric_state(state) -> None:
    import decimal

    import mpmath

    prec, context = state
    mpmath.mp.prec = prec
    decimal.setcontext(context.copy())  # a copy: the next request may change the one it gets


def _die_with_parent() -> None:
    """Linux: the kernel kills the worker when its parent dies, however it
    dies (a SIGKILLed trainer must not leave a worker computing)."""
    import ctypes
    import signal

    if os.environ.get(_DIE_WITH_PARENT) != "1":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve() -> None:
    import importlib
    import resource
    import signal

    # Ctrl-C reaches the whole process group: the parent answers it (one
    # line, and it kills this worker); a traceback from here would only add noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    from rcgrpo.envs import _bfcl  # noqa: F401

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a method that prints must not corrupt the pipe
    import mpmath  # noqa: F401  (warm the import MathAPI needs)

    pristine = _numeric_state()
    _send(stdout, "ready")
    while True:
        try:
            module, function, kwargs = _recv(stdin)
        except EOFError:
            return
        try:
            value = getattr(importlib.import_module(module), function)(**kwargs)
            try:
                pickle.dumps(value)
            except Exception:
                value = str(value)
            reply = (WorkerOutcome.RETURNED, value)
        except MemoryError as exc:
            reply = (WorkerOutcome.EXHAUSTED, f"out of memory ({MEMORY_LIMIT_BYTES >> 30} GiB bound) {exc}".strip())
        except Exception as exc:
            reply = (WorkerOutcome.RAISED, str(exc))
        finally:
            _restore_numeric_state(pristine)
        _send(stdout, reply)


if __name__ == "__main__":
    _serve()
