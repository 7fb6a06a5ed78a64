"""`--resume`: continue a run only as it was configured.

A run's folder holds the config it was started with (config.json). Resuming
compares it with the config given now, key by key:

* settings a field declares `resume_safe` (checkpoint cadence, evaluation,
  device and engine, logging; see `_f` in rcgrpo/config/schema.py) may change: each change
  is logged and recorded;
* every other difference changes what was or will be trained (model, LoRA,
  pipeline, data selection and seed, batch and group sizes, epochs and steps,
  learning rates, loss settings) and is refused with the list of differences,
  unless named in `run.accept_changes`: then it is recorded as accepted.

Records go to `<run>/config_changes.jsonl` (time, key, saved, now, how), so a
run's history of settings stays readable after config.toml is rewritten.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rcgrpo.base import json_input
from rcgrpo.base.errors import UserError, one_line
from rcgrpo.config import Config, config_from_dict, flat_values, resume_safe_keys
from rcgrpo.run.folder import RunFolder
from rcgrpo.run.metrics import log_line

__all__ = ["ResumeError", "Difference", "CHANGES_FILE", "config_differences", "check_resume"]

CHANGES_FILE = RunFolder.CONFIG_CHANGES  # the old name, still imported
# About this invocation, not about the run.
_NOT_COMPARED = frozenset({"run.resume", "run.accept_changes"})


class ResumeError(UserError, ValueError):
    """The run to resume does not exist, or the new settings would change it."""


@dataclass(frozen=True)
class Difference:
    key: str
    saved: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.key} {self.saved!r} -> {self.now!r}"


def config_differences(saved: Config, now: Config) -> list[Difference]:
    """Every setting whose value differs, in declaration order."""
    old, new = flat_values(saved), flat_values(now)
    return [Difference(k, old.get(k), v) for k, v in new.items() if k not in _NOT_COMPARED and old.get(k) != v]


def existing_runs(out_dir: Path) -> list[str]:
    """Names of the runs under `out_dir` (folders holding a saved config)."""
    if not out_dir.is_dir():
        return []
    return sorted(p.name for p in out_dir.iterdir() if RunFolder(p).config_json.is_file())


def load_saved_config(run_dir: Path) -> Config:
    path = RunFolder(run_dir).config_json
    try:
        data = json_input.read_file(path, expect=dict)
        return config_from_dict(data, source=str(path), check_files=False)
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError
        raise ResumeError(f"--resume: the saved config {path} cannot be used: {one_line(exc)}") from exc


def check_resume(cfg: Config, write: bool = True) -> list[Difference]:
    """Refuse a resume that would change the run; record and return the changes
    it makes that are resume-safe or explicitly accepted. `write`: record them
    (the main rank only)."""
    run_dir = cfg.run_dir
    folder = RunFolder(run_dir)
    if not folder.config_json.is_file():
        runs = existing_runs(Path(cfg.run.out_dir))
        there = f"runs there: {', '.join(runs)}" if runs else "there are no runs there"
        raise ResumeError(f"--resume: there is no run {cfg.run.name!r} in {cfg.run.out_dir} ({there}); "
                          "leave out --resume to start it")
    saved = load_saved_config(run_dir)
    differences = config_differences(saved, cfg)
    safe, accepted = resume_safe_keys(), set(cfg.run.accept_changes or [])
    refused = [d for d in differences if d.key not in safe and d.key not in accepted]
    if refused:
        keys = ",".join(d.key for d in refused)
        # A run started with a model named before the default preset applied
        # to every model was started without one: say which preset it had.
        preset = (f" (the run was started with preset {saved.preset or 'none'}; this command line applies "
                  f"{cfg.preset or 'none'}: add --preset {saved.preset or 'none'})" if saved.preset != cfg.preset
                  else "")
        raise ResumeError(
            f"--resume of {run_dir} refused: {len(refused)} setting(s) would change what the run trains: "
            + "; ".join(map(str, refused)) + preset
            + f". Resume with the run's own settings (--config {folder.config_toml} --resume), accept the "
            f"change(s) with --run.accept_changes {keys}, or start a new run under another --name"
        )
    if write and differences:
        with open(folder.config_changes, "a", encoding="utf-8") as f:
            for d in differences:
                how = "resume-safe" if d.key in safe else "accepted"
                f.write(json.dumps({"time": time.time(), "key": d.key, "saved": d.saved, "now": d.now,
                                    "how": how}) + "\n")
                log_line(f"resume: {d} ({how})")
    return differences
