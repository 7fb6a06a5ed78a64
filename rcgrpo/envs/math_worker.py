"""A worker process for BFCL's stateless API classes (MathAPI).

Their slow paths are single native operations (`base**exponent` on big ints,
mpmath at a huge `precision`) that a signal cannot interrupt, so they run in a
child process that the parent kills when a call exceeds its time bound. The
classes hold no state, so a killed worker loses nothing; the next call starts
a new one. Requests and replies are pickled over the child's stdin/stdout:
both ends are this module, and the payload holds only decoded literals.

The runner reports what became of a call (`WorkerOutcome`), unworded: the
executor (rcgrpo.envs.executor) turns every call's outcome into tool text,
so this module needs nothing from it.
"""
from __future__ import annotations

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
    """What became of one call sent to the worker."""

    RETURNED = "returned"  # detail: the method's return value (its str() if it cannot be pickled)
    RAISED = "raised"  # detail: the exception's text
    TIMED_OUT = "timed_out"  # the worker was killed at the time bound; detail None
    WORKER_FAILED = "worker_failed"  # the call never ran to an answer; detail: what broke

    kind: str
    detail: Any = None


class StatelessCallRunner:
    """Parent side: one lazily started worker per process, shared by all
    episodes (the classes it serves are stateless)."""

    _shared: "StatelessCallRunner | None" = None
    _shared_lock = threading.Lock()

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    @classmethod
    def shared(cls) -> "StatelessCallRunner":
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "rcgrpo.envs.math_worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                # unbuffered, so select() on the pipe sees every waiting byte
            )
            # The worker says "ready" once its imports are done, so start-up
            # time never counts against a call's bound.
            ready, _, _ = select.select([self._proc.stdout], [], [], STARTUP_TIMEOUT_S)
            if not ready or _recv(self._proc.stdout) != "ready":
                self.kill()
                raise OSError("math worker did not start")
        return self._proc

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def run(self, module: str, class_name: str, method: str, kwargs: dict, timeout_s: float) -> WorkerOutcome:
        """The outcome of `class_name().method(**kwargs)` in the worker."""
        with self._lock:
            try:
                proc = self._start()
                _send(proc.stdin, (module, class_name, method, kwargs))
                ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
                if not ready:
                    self.kill()
                    return WorkerOutcome(WorkerOutcome.TIMED_OUT)
                ok, value = _recv(proc.stdout)
            except (EOFError, BrokenPipeError, OSError, pickle.UnpicklingError) as exc:
                self.kill()
                return WorkerOutcome(WorkerOutcome.WORKER_FAILED, str(exc))
        return WorkerOutcome(WorkerOutcome.RETURNED if ok else WorkerOutcome.RAISED, value)


def _serve() -> None:
    import importlib

    from rcgrpo.envs import _bfcl  # noqa: F401

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a method that prints must not corrupt the pipe
    import mpmath  # noqa: F401  (warm the import MathAPI needs)

    instances: dict[str, Any] = {}
    _send(stdout, "ready")
    while True:
        try:
            module, class_name, method, kwargs = _recv(stdin)
        except EOFError:
            return
        try:
            if class_name not in instances:
                instances[class_name] = getattr(importlib.import_module(module), class_name)()
            value = getattr(instances[class_name], method)(**kwargs)
            try:
                pickle.dumps(value)
            except Exception:
                value = str(value)
            reply = (True, value)
        except Exception as exc:
            reply = (False, str(exc))
        _send(stdout, reply)


if __name__ == "__main__":
    _serve()
