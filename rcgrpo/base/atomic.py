"""Files that are either the old version or the new one, never half of either.

Everything the project writes for a person or a later run (configs, result
files, data sets, markers) goes through here: the content is written to a
temporary file in the same folder, flushed and fsynced, and renamed over the
target (a rename within one filesystem is atomic). A crash or an exception
before the rename leaves the previous file as it was (or none) and removes the
temporary file.

Only a regular file is ever replaced. A symbolic link is followed (the file
it points to is replaced; the link stays); a device or a pipe (`--out
/dev/null`) is written through, as a shell redirection would; a folder is
refused.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import os
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_output", "atomic_write_text", "fsync_dir"]


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, encoding: str = "utf-8") -> Iterator[IO[str]]:
    """A text stream whose content replaces `path` when the block ends cleanly."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    if path.exists() and not path.is_file():
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder, not a file to write", str(path))
        # A device or a pipe: not ours to replace, and nothing to keep whole.
        with open(path, "w", encoding=encoding) as f:
            yield f
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path)
    # Hidden and per-process, so two writers never share a temporary file and
    # a leftover one is not mistaken for output.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    f = open(tmp, "w", encoding=encoding)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # closing flushes, which fails again on a full disk
            f.close()
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            # A failed write or flush names no file: say which one it was.
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`path` holds exactly `text` afterwards, or is unchanged."""
    with atomic_output(path) as f:
        f.write(text)
    return Path(path)


def _remove_orphans(path: Path) -> None:
    """Temporary files of `path` left by writers that were killed."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a folder's entries (renames, new files) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
