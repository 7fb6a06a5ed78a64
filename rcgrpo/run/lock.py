"""One run folder, one writer.

A trainer holds an exclusive `flock` on `<run folder>/.lock` from the moment
it claims the folder until it exits, and writes its pid into the file. A
second trainer with the same `--name` (fresh or `--resume`) fails at start
in one line naming the holder's pid. The kernel drops the lock when its
holder dies however it dies, so a lock left by a killed run needs no
clean-up: the next start takes it over (the stale pid is overwritten).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from rcgrpo.base.errors import UserError
from rcgrpo.run.folder import RunFolder


class RunInUseError(UserError, RuntimeError):
    """Another live process holds the run folder."""


def in_use(folder: Path, holder: str) -> RunInUseError:
    return RunInUseError(f"run folder {folder} is in use by process {holder}: wait for it to finish, "
                         "or pass another --name")


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode("ascii", "replace").strip()
    return text if text.isdigit() else "unknown"


class RunFolderLock:
    """`with RunFolderLock(folder):` holds the folder for this process."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._fd: int | None = None

    def acquire(self) -> "RunFolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(RunFolder(self.folder).lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise in_use(self.folder, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        # The file stays: removing it would let a third process lock a new
        # file while a second still waits on the old one.
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunFolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder_of(folder: str | os.PathLike) -> str | None:
    """The pid of the live process holding `folder`, or None when no one does."""
    path = RunFolder(folder).lock
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)  # closing drops a shared lock we may have taken
    return None
