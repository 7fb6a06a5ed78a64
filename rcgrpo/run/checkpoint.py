"""Atomic, verified training checkpoints with fallback to the last good one.

Layout under a checkpoint root (suggested: ``runs/<name>/checkpoints/<stage>``)::

    ckpt-00000040/
      model/            save_pretrained (safetensors) + tokenizer: loadable by
                        transformers and vLLM as a plain model folder; in a
                        LoRA run the adapter only (adapter_model.safetensors,
                        adapter_config.json): resume needs nothing more
      optimizer.pt      optimizer.state_dict()          (if given)
      scheduler.pt      scheduler.state_dict()          (if given)
      rng.pt            python / numpy / torch (+ CUDA) RNG states
      state.json        step, stage, data position, extra
      run_config.json   the run's config                (if given)
      MANIFEST.json     size + sha256 of every file above; written LAST
    latest              name of the newest complete checkpoint

Why it is safe against a kill at any point:

* everything is written into ``ckpt-XXXXXXXX.tmp/``, fsynced, and only then
  renamed to ``ckpt-XXXXXXXX/`` (a rename is atomic on one filesystem), so a
  ``ckpt-*`` folder without ``.tmp`` was complete when it was renamed;
* the manifest, written last inside the temp folder, lets ``load_latest``
  detect later damage (a truncated or edited file) and fall back;
* ``latest`` is replaced atomically after the rename; ``load_latest`` does not
  depend on it (it scans and verifies), it is there for people and tools;
* old checkpoints are pruned only after the new one is in place;
* saving a step that already exists moves the old folder to ``.old`` before
  the rename: a kill between those two renames leaves ``ckpt-N.old`` and a
  complete ``ckpt-N.tmp`` and no ``ckpt-N``; ``load_latest`` finishes such a
  save (the verified ``.tmp`` becomes ``ckpt-N``, else ``.old`` goes back), and
  likewise promotes a verified ``.tmp`` whose save was killed just before its
  rename, so a resume starts from the newest complete checkpoint.

One writer per checkpoint root is assumed (the trainer's main process).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rcgrpo.base import json_input
from rcgrpo.base.atomic import atomic_write_text, fsync_dir
from rcgrpo.base.errors import UserError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "SaveError",
    "write_failure",
    "save_checkpoint",
    "load_latest",
    "list_checkpoints",
    "verify_checkpoint",
]

FORMAT = 1
MANIFEST = "MANIFEST.json"
LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{8})$")
_TMP = re.compile(r"^ckpt-(\d{8})\.tmp$")
_OLD = re.compile(r"^ckpt-(\d{8})\.old$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used (the message says which file and why)."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped; the message names it and the reason."""


@dataclass
class Checkpoint:
    """A verified checkpoint on disk. Nothing is loaded until ``restore``."""

    path: Path
    step: int
    stage: Optional[str] = None
    data_position: Any = None
    extra: dict = field(default_factory=dict)
    config: Optional[dict] = None

    @property
    def model_dir(self) -> Path:
        """A plain HF model folder: ``from_pretrained`` / ``vllm.LLM`` load it
        (a peft adapter folder for a LoRA run)."""
        return self.path / "model"

    def restore(
        self,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        rng: bool = True,
        generators: Optional[dict[str, torch.Generator]] = None,
    ) -> "Checkpoint":
        """Load what is given, in place: optimizer, scheduler, RNGs. The
        weights are the model's to load (`rcgrpo.model.loading.load_model_weights`
        from `model_dir`; a policy: `rcgrpo.model.policy.TrainablePolicy.restore`).

        Raises CheckpointError if something asked for is not in the checkpoint.
        """
        if optimizer is not None:
            optimizer.load_state_dict(self._load_pt("optimizer.pt"))
        if scheduler is not None:
            scheduler.load_state_dict(self._load_pt("scheduler.pt"))
        if rng or generators:
            states = self._load_pt("rng.pt")
            if rng:
                _set_rng_states(states)
            for name, gen in (generators or {}).items():
                if name not in states.get("generators", {}):
                    raise CheckpointError(f"{self.path}: no state for generator {name!r}")
                gen.set_state(states["generators"][name])
        return self

    def _load_pt(self, name: str):
        p = self.path / name
        if not p.is_file():
            raise CheckpointError(f"{p} is missing: the checkpoint was saved without it")
        # weights_only: a checkpoint is data; never run pickled code from disk.
        return torch.load(p, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------ saving


class SaveError(UserError, OSError):
    """A checkpoint or a model could not be written (disk full, a file-size
    limit, no permission); what was saved before is kept."""


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


# What torch.save's stream writer says when a write fails (it keeps no errno):
# "PytorchStreamWriter failed writing file ...: file write failed", or
# "[enforce fail at inline_container.cc:...] unexpected pos ..." after
# "basic_ios::clear: iostream error".
_TORCH_WRITE_FAILED = ("file write failed", "PytorchStreamWriter", "inline_container", "iostream error")


def write_failure(exc: BaseException, folder: Optional[Path] = None) -> Optional[str]:
    """The reason when `exc` is a failed write into `folder` (disk full, a
    file-size limit, no permission), else None (a bug). The writers wrap the
    OS's error in their own types: safetensors raises SafetensorError("...
    I/O error: No space left on device (os error 28)"), torch.save a
    RuntimeError without the errno (then the folder's free space tells)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    text = " ".join(str(exc).split())
    if type(exc).__name__ == "SafetensorError":
        code = _OS_ERROR.search(text)
        return os.strerror(int(code.group(1))) if code else None
    if isinstance(exc, RuntimeError):
        context = " ".join(str(exc.__context__ or "").split())
        if any(m in text or m in context for m in _TORCH_WRITE_FAILED):
            try:
                full = folder is not None and shutil.disk_usage(folder).free < (1 << 20)
            except OSError:
                full = False
            return os.strerror(28) if full else "a write failed (the disk full, or a file-size limit)"
    return None


def _previous(root: Path) -> str:
    done = list_checkpoints(root) if root.is_dir() else []
    return f"the previous checkpoint {done[-1]} is intact" if done else "no earlier checkpoint exists"


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    *,
    stage: Optional[str] = None,
    data_position: Any = None,
    config: Optional[dict] = None,
    extra: Optional[dict] = None,
    generators: Optional[dict[str, torch.Generator]] = None,
    keep_last: int = 3,
    model_state_dict: Optional[dict[str, torch.Tensor]] = None,
    optimizer_state_dict: Optional[dict] = None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; return its folder.

    ``data_position``, ``config`` and ``extra`` must be JSON-serialisable
    (checked before anything is written). ``keep_last`` newest checkpoints are
    kept; older ones are deleted once the new one is complete.
    ``model_state_dict`` / ``optimizer_state_dict`` are written instead of the
    model's and optimizer's own (an FSDP run passes the gathered full states).
    """
    _check_save_arguments(step, keep_last)
    state_text, config_text = _metadata_texts(step, stage, data_position, extra, config)

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp, old = _step_folders(root, step)
    _empty_temp_folder(tmp)
    try:
        _write_training_state(tmp, model, tokenizer, optimizer, scheduler, generators,
                              model_state_dict, optimizer_state_dict)
        _write_metadata(tmp, state_text, config_text)
        _write_manifest(tmp, step)  # last: only a completely written folder has one
        _fsync_tree(tmp)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # earlier checkpoints are untouched
        error = _save_error(exc, root, step)
        if error is None:
            raise
        raise error from exc

    # The commit, in this order: a kill between any two of these lines leaves
    # folders that load_latest recovers (the module's docstring says how).
    resaved = final.exists()  # the same step saved again (e.g. after a resume)
    if resaved:
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    if resaved:
        shutil.rmtree(old, ignore_errors=True)
    _write_latest(root, final.name)
    _prune(root, keep_last, keep=final)
    return final


def _check_save_arguments(step: int, keep_last: int) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")


def _metadata_texts(step: int, stage: Optional[str], data_position: Any, extra: Optional[dict],
                    config: Optional[dict]) -> tuple[str, Optional[str]]:
    """The texts of state.json and of run_config.json (None without a config)."""
    state = {"format": FORMAT, "step": int(step), "stage": stage, "data_position": data_position,
             "extra": extra or {}, "time": time.time()}
    state_text = json.dumps(state, indent=2)  # fails early on non-JSON data
    config_text = json.dumps(config, indent=2) if config is not None else None
    return state_text, config_text


def _step_folders(root: Path, step: int) -> tuple[Path, Path, Path]:
    """Step ``step``'s checkpoint folder, the temp folder its save writes, and
    the name a re-save moves the step's previous checkpoint to."""
    final, tmp, old = (root / f"ckpt-{step:08d}{suffix}" for suffix in ("", ".tmp", ".old"))
    return final, tmp, old


def _empty_temp_folder(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a save that was killed
    tmp.mkdir()


def _write_training_state(
    tmp: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: Optional[torch.optim.Optimizer],
    scheduler: Any,
    generators: Optional[dict[str, torch.Generator]],
    model_state_dict: Optional[dict[str, torch.Tensor]],
    optimizer_state_dict: Optional[dict],
) -> None:
    """model/ (weights, tokenizer), optimizer.pt, scheduler.pt and rng.pt."""
    model.save_pretrained(str(tmp / "model"), safe_serialization=True, state_dict=model_state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "model"))
    if optimizer is not None:
        state = optimizer.state_dict() if optimizer_state_dict is None else optimizer_state_dict
        torch.save(state, tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(_get_rng_states(generators), tmp / "rng.pt")


def _write_metadata(tmp: Path, state_text: str, config_text: Optional[str]) -> None:
    (tmp / "state.json").write_text(state_text)
    if config_text is not None:
        (tmp / "run_config.json").write_text(config_text)


def _save_error(exc: BaseException, root: Path, step: int) -> Optional[SaveError]:
    """The one-line SaveError when `exc` is a failed write, else None (a bug,
    which the caller re-raises as it is)."""
    reason = write_failure(exc, root)
    if reason is None:
        return None
    return SaveError(f"checkpoint step {step} could not be written to {root}: {reason}; "
                     f"{_previous(root)} (free space there, then --resume)")


def _write_manifest(folder: Path, step: int) -> None:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            rel = p.relative_to(folder).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {"format": FORMAT, "step": step, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n")


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    done = list_checkpoints(root)
    for path in done[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    # Temp folders of other steps are leftovers of killed saves.
    for p in root.iterdir():
        if p.is_dir() and (_TMP.match(p.name) or p.name.endswith(".old")):
            shutil.rmtree(p, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in [folder, *[p for p in folder.rglob("*") if p.is_dir()]]:
        fsync_dir(d)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- RNG state


def _get_rng_states(generators: Optional[dict[str, torch.Generator]] = None) -> dict:
    # numpy's state holds an ndarray; as plain ints it loads with weights_only.
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in (generators or {}).items()},
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    random.setstate(_tuplify(states["python"]))
    name, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _tuplify(x):
    """random.setstate wants tuples; a load may hand back lists."""
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ------------------------------------------------------------------ loading


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Renamed (i.e. complete-when-written) checkpoint folders, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def verify_checkpoint(path: str | os.PathLike, full: bool = True) -> None:
    """Raise CheckpointError naming the first problem found.

    ``full=False`` checks presence and sizes only (skips hashing: for very
    large models when the disk is trusted).
    """
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{mpath} is missing: the save did not finish")
    try:
        manifest = json_input.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{mpath} is unreadable: {e}") from e
    if not isinstance(files, dict) or not all(
        isinstance(meta, dict) and type(meta.get("size")) is int and isinstance(meta.get("sha256"), str)
        for meta in files.values()
    ):
        raise CheckpointError(f"{mpath} is malformed: 'files' must map each path to its size and sha256")
    if "state.json" not in files or not any(f.startswith("model/") for f in files):
        raise CheckpointError(f"{mpath} lists no state.json or no model files")
    for rel in files:
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or rel == MANIFEST:
            raise CheckpointError(f"{mpath} lists {rel!r}, a path outside the checkpoint folder")
    # Exactly the listed files: one that the save did not write (put there
    # later, by hand or by another program) would be loaded unverified.
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if not p.is_dir()} - {MANIFEST}
    unlisted = sorted(present - set(files))
    if unlisted:
        raise CheckpointError(f"{path / unlisted[0]} is not listed in the manifest ({len(unlisted)} such files)")
    for rel, meta in files.items():
        p = path / rel
        if p.is_symlink():
            raise CheckpointError(f"{p} is a symbolic link, not a file the save wrote")
        if not p.is_file():
            raise CheckpointError(f"{p} is missing")
        size = p.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"{p} is {size} bytes, the manifest says {meta['size']} (truncated or overwritten)")
        if full and _sha256(p) != meta["sha256"]:
            raise CheckpointError(f"{p} does not match its sha256 in the manifest (corrupt)")


def load_latest(root: str | os.PathLike, full_verify: bool = True) -> Optional[Checkpoint]:
    """The newest checkpoint under ``root`` that verifies, or None if there is none.

    Every checkpoint skipped on the way (corrupt, partial) and every leftover
    ``.tmp`` folder is reported with a CheckpointWarning naming the file and
    the reason. If checkpoints exist but none is usable, CheckpointError is
    raised rather than silently starting over.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    recover_interrupted_saves(root, full_verify)
    for p in sorted(root.iterdir()):
        if p.is_dir() and _TMP.match(p.name):
            warnings.warn(f"{p}: incomplete checkpoint left by an interrupted save; ignored", CheckpointWarning,
                          stacklevel=2)
    reasons = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path, full=full_verify)
            return _read_checkpoint(path)
        except (CheckpointError, ValueError, OSError) as e:
            reasons.append(f"{path.name}: {e}")
            warnings.warn(f"checkpoint {path} is unusable: {e}; trying the previous one", CheckpointWarning,
                          stacklevel=2)
    if reasons:
        raise CheckpointError(f"no usable checkpoint in {root}:\n  " + "\n  ".join(reasons))
    return None


def _read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint's metadata; CheckpointError for any shape it must not have."""
    state = json_input.loads((path / "state.json").read_text())
    cfg_path = path / "run_config.json"
    config = json_input.loads(cfg_path.read_text()) if cfg_path.is_file() else None
    if not isinstance(state, dict) or type(state.get("step")) is not int or state["step"] < 0:
        raise CheckpointError(f"{path / 'state.json'} has no non-negative integer 'step'")
    extra = state.get("extra") or {}
    if not isinstance(extra, dict) or not isinstance(state.get("stage"), (str, type(None))) or not isinstance(
            config, (dict, type(None))):
        raise CheckpointError(f"{path} has metadata of the wrong types (state.json 'stage'/'extra', run_config.json)")
    return Checkpoint(path=path, step=state["step"], stage=state.get("stage"),
                      data_position=state.get("data_position"), extra=extra, config=config)


def recover_interrupted_saves(root: str | os.PathLike, full_verify: bool = True) -> list[str]:
    """Finish or undo the saves under `root` that a kill stopped between
    writing and renaming; returns what was done (each also warned).

    A ``ckpt-N.tmp`` that verifies is the step's newest save, complete (its
    manifest is written last) but not renamed: it becomes ``ckpt-N``, in the
    same two renames a save makes (an existing ``ckpt-N`` to ``.old`` first).
    Failing that, a ``ckpt-N.old`` without ``ckpt-N`` (the step's previous
    save, moved aside for a re-save that did not finish) goes back; next to
    its ``ckpt-N`` it is the leftover of a finished re-save and is removed.
    Call it from the run's one writer; a kill during it is recovered the same
    way next time.
    """
    root = Path(root)
    done = []
    names = {p.name for p in root.iterdir() if p.is_dir()}
    steps = {int(m.group(1)) for n in names for m in [_TMP.match(n) or _OLD.match(n)] if m}
    for step in sorted(steps):
        final, tmp, old = _step_folders(root, step)
        if tmp.is_dir() and _verifies(tmp, full_verify):
            if final.is_dir():
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(root)
            done.append(f"{tmp.name} was complete: renamed to {final.name}")
        elif old.is_dir() and not final.is_dir():
            os.rename(old, final)
            fsync_dir(root)
            done.append(f"{old.name} restored as {final.name} (its re-save did not finish)")
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    for line in done:
        warnings.warn(f"{root}: {line}", CheckpointWarning, stacklevel=3)
    return done


def _verifies(path: Path, full: bool) -> bool:
    try:
        verify_checkpoint(path, full=full)
    except CheckpointError:
        return False  # a save killed while writing: load_latest reports it, the next save removes it
    return True


