"""Where every file of a run lives: ``runs/<name>/`` and the names in it.

A module that reads or writes a run's files asks a ``RunFolder`` for the
path rather than joining names, so that the folder's layout is written down
once, here::

    runs/<name>/
      .lock                       the live trainer's pid (rcgrpo.run.lock)
      config.toml, config.json    the run's settings (--config reads the first, --resume compares the second)
      config_changes.jsonl        settings a --resume changed (rcgrpo.pipeline.resume)
      metrics.jsonl               per-step metrics (rcgrpo.run.metrics); cut lines: metrics.dropped.jsonl
      tb/<stage>/                 TensorBoard's copy of them (rcgrpo.run.trackers)
      rctp_data.jsonl             the rctp-data stage's RCTP set
      checkpoints/<stage>/        an unfinished stage's checkpoints (rcgrpo.run.checkpoint)
      models/<stage>/             a finished stage's policy, where the next stage starts
      stages/<stage>.done         written once the stage's outputs are in place
      stages/<stage>.pushed       the Hub commit its model was pushed as
      eval.json, eval.md          the BFCL table (rcgrpo.evaluation.rollouts)
      report.md, *.png            the report and its plots (rcgrpo.report)
"""
from __future__ import annotations

import os
from pathlib import Path


class RunFolder:
    """The paths of one run folder. Nothing is created here; only the
    folder's listing is read (`plots`, `holds_nothing_saved`, `taken`)."""

    CONFIG_TOML = "config.toml"
    CONFIG_JSON = "config.json"
    CONFIG_CHANGES = "config_changes.jsonl"
    LOCK = ".lock"
    METRICS = "metrics.jsonl"
    METRICS_DROPPED = "metrics.dropped.jsonl"
    TENSORBOARD = "tb"
    RCTP_DATA = "rctp_data.jsonl"
    CHECKPOINTS = "checkpoints"
    MODELS = "models"
    STAGES = "stages"
    DONE = "{stage}.done"
    PUSHED = "{stage}.pushed"
    EVAL_JSON = "eval.json"
    EVAL_MD = "eval.md"
    REPORT = "report.md"
    # What a start writes into its folder before any stage's work: a folder
    # holding nothing else has nothing saved (a start that failed removes it).
    BOOKKEEPING = frozenset({LOCK, CONFIG_TOML, CONFIG_JSON})

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config_toml(self) -> Path:
        return self.path / self.CONFIG_TOML

    @property
    def config_json(self) -> Path:
        return self.path / self.CONFIG_JSON

    @property
    def config_changes(self) -> Path:
        return self.path / self.CONFIG_CHANGES

    @property
    def lock(self) -> Path:
        return self.path / self.LOCK

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def metrics_dropped(self) -> Path:
        return self.path / self.METRICS_DROPPED

    def tensorboard(self, stage: str) -> Path:
        return self.path / self.TENSORBOARD / stage

    @property
    def rctp_data(self) -> Path:
        return self.path / self.RCTP_DATA

    def checkpoints(self, stage: str) -> Path:
        return self.path / self.CHECKPOINTS / stage

    def stage_model(self, stage: str) -> Path:
        return self.path / self.MODELS / stage

    def done_marker(self, stage: str) -> Path:
        return self.path / self.STAGES / self.DONE.format(stage=stage)

    def pushed_marker(self, stage: str) -> Path:
        return self.path / self.STAGES / self.PUSHED.format(stage=stage)

    @property
    def eval_json(self) -> Path:
        return self.path / self.EVAL_JSON

    @property
    def eval_md(self) -> Path:
        return self.path / self.EVAL_MD

    @property
    def report(self) -> Path:
        return self.path / self.REPORT

    def plots(self) -> list[Path]:
        return sorted(self.path.glob("*.png"))

    def holds_nothing_saved(self) -> bool:
        """The folder exists and holds only what a start writes first (BOOKKEEPING)."""
        return self.path.is_dir() and all(p.name in self.BOOKKEEPING for p in self.path.iterdir())

    def taken(self) -> bool:
        """Another run's folder: it holds more than a lock file (a start that
        stopped early leaves only that, and the folder is free)."""
        return self.path.exists() and any(p.name != self.LOCK for p in self.path.iterdir())
