"""Claiming a run folder: a new run takes a free name, rank 0 holds the
folder's lock for the whole run, and a start that fails before saving
anything leaves no folder behind."""
from __future__ import annotations

import contextlib

from rcgrpo.base import distributed
from rcgrpo.config import Config
from rcgrpo.run.folder import RunFolder
from rcgrpo.run.lock import RunFolderLock, RunInUseError, holder_of, in_use
from rcgrpo.run.metrics import log_line


def claim_fresh_run_dir(cfg: Config) -> None:
    """A new run never writes into an existing run's folder: it takes the
    first free `<name>-2`, `<name>-3`, ... (`--resume` continues the named one)."""
    holder = holder_of(cfg.run_dir)
    if holder is not None:
        raise in_use(cfg.run_dir, holder)
    base_dir, base, k = cfg.run_dir, cfg.run.name, 1
    while RunFolder(cfg.run_dir).taken():
        k += 1
        cfg.run.name = f"{base}-{k}"
    if k > 1:
        # --resume continues only a folder holding a run's saved config.
        hint = (f"pass --resume to continue {base}" if RunFolder(base_dir).config_json.is_file()
                else f"{base_dir} holds no run to resume")
        log_line(f"{base_dir} exists: this run uses {cfg.run_dir} ({hint})")


@contextlib.contextmanager
def claimed_run_folder(cfg: Config):
    """The run's folder, held for the body. Rank 0 claims it and holds its
    lock; every rank learns the name (`cfg.run.name`), or the refusal, from
    it. A folder this start made is removed again if the body fails before
    anything was saved in it."""
    lock, refused, created = None, None, False
    if distributed.is_main():
        try:
            if not cfg.run.resume:
                claim_fresh_run_dir(cfg)
                created = not cfg.run_dir.exists() or RunFolder(cfg.run_dir).holds_nothing_saved()
            if not cfg.run.resume or cfg.run_dir.is_dir():  # a run to resume that is missing: check_resume says so
                lock = RunFolderLock(cfg.run_dir).acquire()
        except RunInUseError as exc:
            refused = str(exc)
    cfg.run.name, refused = distributed.broadcast_object((cfg.run.name, refused))
    if refused:
        raise RunInUseError(refused)
    folder = RunFolder(cfg.run_dir)
    try:
        yield folder
    except BaseException:
        if created and folder.holds_nothing_saved():
            # This start made the folder and saved nothing into it: the retry
            # gets the same name, not <name>-2 beside an empty run. Removed
            # while still locked (every locker is non-blocking, so no one
            # waits on the lock file that goes with it).
            with contextlib.suppress(OSError):  # the failure itself is what to report
                for p in folder.path.iterdir():
                    p.unlink()
                folder.path.rmdir()
        raise
    finally:
        if lock is not None:
            lock.release()
