"""Per-step metrics: ``runs/<name>/metrics.jsonl`` (+ the trackers of
``run.report_to``: TensorBoard, W&B, MLflow; rcgrpo/run/trackers.py), and tqdm conventions.

Every ``log`` call writes one JSON object per line and flushes it, so a
killed run keeps every step it finished::

    {"stage": "rc-grpo", "step": 12, "time": 1767000000.0, "reward_mean": 0.4, ...}

Several stages share the file; each record names its stage, and steps count
per stage. Opening a logger for a stage first cuts the file at the first
record that the new process will redo: a record of *this* stage with
``step > resume_step`` (every record of this stage when starting fresh,
``resume_step=None``), and everything after it, since later lines were
produced from the run being replaced. The cut lines are appended to
``metrics.dropped.jsonl`` rather than lost, and so is the text of any line
that cannot be read (a torn last line, a corrupted one), with a warning. So after ``--resume`` from a
checkpoint at step k, the file continues at k + 1 with no duplicates.

Use the names in ``STANDARD_METRICS`` where they apply: ``rcgrpo.report.summary``
plots them by name.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from rcgrpo.base import json_input
from rcgrpo.base.atomic import atomic_output
from rcgrpo.base.errors import UserError
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.run.folder import RunFolder
from rcgrpo.run.trackers import open_trackers

__all__ = ["MetricsLogger", "DiscardingLogger", "STANDARD_METRICS", "read_records", "MetricsFileError", "progress",
           "quiet_library_progress", "log_line"]

METRICS_FILE = RunFolder.METRICS  # the old name, for code written against it; goes in rcgrpo 0.2

# Names the report knows (name -> what it is); rcgrpo.report.plots draws them by name.
# Any other numeric key is logged and listed in report.md's per-stage summary.
STANDARD_METRICS = {
    "reward_mean": "mean reward over all rollouts of the step",
    "reward_mean_high": f"mean reward of rollouts conditioned on {HIGH_REWARD}",
    "reward_mean_low": f"mean reward of rollouts conditioned on {LOW_REWARD}",
    "sampled_reward_high": f"sampled reward on a fixed sample of training prompts under {HIGH_REWARD} "
                           "(_lo / _hi: its 95% Wilson interval; _n: rollouts)",
    "sampled_reward_low": f"the same under {LOW_REWARD}",
    "sampled_reward_none": "the same without a reward token",
    "zero_var_frac": "fraction of groups whose G rewards are all equal (no gradient)",
    "rollouts_played": "rollouts the step generated (dynamic sampling's extra draws included)",
    "update_skipped": "1 when the step's gradient was exactly zero and no pass was made",
    "engine_replays": "times the step's rollouts were played again after the engine returned a non-finite "
                      "log-prob (weights pushed anew; rcgrpo.rollout.engine.EngineFault)",
    "probe_engine_replays": "the same for the sampled-reward probe logged with the step",
    "steer": "RCTP: log p(expert's token | high) - log p(expert's token | low) at each pair's first divergent "
             "token, mean over pairs (nats)",
    "steer_logodds": "the same in log-odds",
    "p_expert_high": f"RCTP: p(expert's token) at the first divergent token under {HIGH_REWARD}",
    "p_expert_low": f"the same under {LOW_REWARD}",
    "adv_std": "std of the advantages over the batch",
    "entropy": "mean policy entropy on generated tokens",
    "kl": "mean KL to the reference policy on generated tokens",
    "clip_frac": "fraction of generated tokens whose ratio was clipped",
    "loss": "training loss",
    "grad_norm": "gradient norm before clipping",
    "lr": "learning rate",
    "tokens_per_s": "trained tokens per second",
    "forward_tokens": "tokens the decoder computed per pass over the batch (shared prompt prefixes once)",
    "tree_parity_max_abs": "max |log p| difference between the shared-prefix (tree) forward and every sequence "
                           "forwarded whole, over one micro-batch's loss tokens, at the steps checked (nats; "
                           "_mean_abs: the mean; _tokens: the loss tokens; _bound: the run stops above it; "
                           "rcgrpo.training.parity)",
    "tree_parity_s": "seconds the tree parity check's two extra forwards took",
    "rollout_s": "seconds spent generating rollouts",
    "update_s": "seconds spent in forward/backward/optimizer",
}


class MetricsFileError(UserError, RuntimeError):
    """The metrics file is missing or unreadable (the message says where)."""


def is_number(value: Any) -> bool:
    """A metric value that is a number: an int or float, not a bool (NaN and
    inf included: metrics.jsonl keeps them)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A metric value that can be plotted, averaged or sent to a tracker."""
    return is_number(value) and math.isfinite(value)


def _plain(value: Any) -> Any:
    """Tensors / numpy scalars -> Python numbers, so json can write them."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError) as e:  # a multi-element tensor
            raise TypeError(f"metric value must be a scalar, got shape {tuple(value.shape)}") from e
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"metric value must be a number, bool, str or None, got {type(value).__name__}")


def _flatten(metrics: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = _plain(v)
    return out


def read_records(path: str | os.PathLike, strict: bool = True,
                 unreadable: Optional[list[tuple[int, str]]] = None) -> tuple[list[dict], list[str]]:
    """Parse a metrics file; return (records, problems).

    A truncated last line (a process killed mid-write) is skipped and noted in
    ``problems``. Any other unreadable line raises MetricsFileError when
    ``strict``, else it is skipped and noted. Each skipped line, as (line
    number, text), is appended to ``unreadable`` when one is given.
    """
    path = Path(path)
    if not path.is_file():
        raise MetricsFileError(f"no metrics file at {path}: did the run log any step?")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records, problems = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json_input.loads(line)
            if not isinstance(rec, dict) or type(rec.get("step")) is not int:
                raise ValueError("not an object with an integer 'step'")
            if not isinstance(rec.get("stage", ""), (str, type(None))):
                raise ValueError("'stage' is not a string")
        except ValueError as e:
            msg = f"{path}:{i}: unreadable metrics line ({e})"
            if i == len(lines):
                problems.append(msg + "; the last line, probably cut off by a kill: skipped")
            elif strict:
                raise MetricsFileError(msg) from e
            else:
                problems.append(msg + ": skipped")
            if unreadable is not None:
                unreadable.append((i, line))
            continue
        records.append(rec)
    return records, problems


class MetricsLogger:
    """Append-only JSONL metrics for one stage of a run (+ its trackers).

    Args:
        run_dir: the run folder; the file is ``run_dir/metrics.jsonl``.
        stage: name stamped into every record (e.g. "rctp", "rc-grpo").
        resume_step: None for a fresh start of this stage; k to continue after
            a checkpoint at step k (records of this stage with step > k, and
            everything after them, are cut; see the module docstring).
        report_to: trackers that also get every record's finite numbers
            (rcgrpo.run.trackers: "tensorboard", "wandb", "mlflow"); none by
            default (a run passes its ``run.report_to``).
        run_name, config: the run's name and settings, for the trackers
            that record them (W&B, MLflow).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        stage: Optional[str] = None,
        resume_step: Optional[int] = None,
        report_to: Sequence[str] = (),
        run_name: Optional[str] = None,
        config: Optional[dict] = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.folder = RunFolder(self.run_dir)
        self.path = self.folder.metrics
        self.stage = stage
        self.resume_step = resume_step
        self._cut()
        self._file = open(self.path, "a", encoding="utf-8")
        try:
            self._trackers = open_trackers(report_to, self.run_dir, stage or "main", resume_step, run_name, config)
        except BaseException:
            self._file.close()
            raise

    def _cut(self) -> None:
        if not self.path.is_file():
            return
        unreadable: list[tuple[int, str]] = []
        records, problems = read_records(self.path, strict=False, unreadable=unreadable)
        for p in problems:
            warnings.warn(f"{p}; its text is kept in {self.folder.metrics_dropped}", stacklevel=3)
        cut = len(records)
        for i, rec in enumerate(records):
            if rec.get("stage") == self.stage and (self.resume_step is None or rec["step"] > self.resume_step):
                cut = i
                break
        kept, dropped = records[:cut], records[cut:]
        if dropped or unreadable:
            with open(self.folder.metrics_dropped, "a", encoding="utf-8") as f:
                for rec in dropped:
                    f.write(json.dumps(rec) + "\n")
                # An unreadable line is kept as its text: nothing is lost,
                # and the file stays one JSON object per line.
                for lineno, text in unreadable:
                    f.write(json.dumps({"unreadable_line": lineno, "text": text}) + "\n")
        if dropped or problems:
            with atomic_output(self.path) as f:
                for rec in kept:
                    f.write(json.dumps(rec) + "\n")

    def log(self, step: int, metrics: Optional[dict] = None, **more: Any) -> dict:
        """Write one record for ``step``; nested dicts become "a/b" keys.

        Values may be Python/numpy numbers or 0-d tensors. NaN and inf are
        kept (written as NaN / Infinity, which Python's json reads back).
        Returns the record written.
        """
        values = _flatten({**(metrics or {}), **more})
        reserved = {"stage", "step", "time"} & values.keys()
        if reserved:
            raise ValueError(f"metric names {sorted(reserved)} are reserved")
        record = {"stage": self.stage, "step": int(step), "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._trackers:
            scalars = {k: v for k, v in values.items() if is_finite_number(v)}
            for tracker in self._trackers:
                tracker.log(scalars, int(step))
        return record

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DiscardingLogger:
    """MetricsLogger's interface writing nothing: what ranks other than 0 of a
    torchrun job use (rank 0 logs the metrics reduced over all ranks)."""

    def log(self, step: int, metrics: Optional[dict] = None, **more: Any) -> dict:
        return {"step": int(step), **_flatten({**(metrics or {}), **more})}

    def close(self) -> None:
        pass

    def __enter__(self) -> "DiscardingLogger":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _main_rank() -> bool:
    # torchrun's RANK; read from the environment so this module needs no torch.
    return os.environ.get("RANK", "0") == "0"


# ------------------------------------------------------------- progress bars


def progress(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: str = "",
             unit: str = "it", leave: bool = True, **kwargs):
    """tqdm with the project's conventions.

    * ``desc`` names the loop ("rctp", "rc-grpo", "rollouts"); inner loops
      pass ``leave=False``.
    * On a terminal every bar redraws often. In a log file (CI, nohup) only
      the outer bars print, one line each at most every 30 s: an inner bar
      there would add a line per update.
    * ``RCGRPO_PROGRESS=0`` turns every bar off; ``disable=True`` this one.
    * Print with ``log_line`` (tqdm.write) while a bar is active.
    """
    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 0.5 if tty else 30.0)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs["disable"] = bool(kwargs.get("disable")) or os.environ.get("RCGRPO_PROGRESS", "1") == "0" \
        or not _main_rank() or (not tty and not leave)
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, **kwargs)


def quiet_library_progress() -> None:
    """In a log file, turn off the bars transformers draws per weight loaded
    and per shard written (a line per update there); ours stay."""
    if sys.stderr.isatty():
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def log_line(message: str) -> None:
    """Print a line without breaking active progress bars (rank 0 only)."""
    from tqdm.auto import tqdm

    if not _main_rank():
        return

    tqdm.write(message, file=sys.stderr)
