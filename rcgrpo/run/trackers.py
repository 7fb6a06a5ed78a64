"""Where a run's metrics go besides metrics.jsonl (`run.report_to`, as TRL's
`report_to`): TensorBoard (the default), Weights & Biases, MLflow.

Each tracker gets the finite numbers of every record metrics.jsonl gets, at
the record's step. Steps count per stage, so a stage is a tracker run of its
own: TensorBoard writes ``run_dir/tb/<stage>``; W&B and MLflow start one run
per stage named ``<run name>/<stage>`` (W&B groups them by the run's name,
MLflow tags them ``rcgrpo.run``), with the run's settings as its config /
params. W&B and MLflow read their own environment as usual (WANDB_PROJECT,
WANDB_MODE=offline, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME; the project
and experiment default to "rcgrpo").

A package is imported only when its tracker opens; validation asks
`missing()` first, so that a chosen tracker that is not installed is a
one-line error before any work.
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from rcgrpo.base.errors import UserError
from rcgrpo.run.folder import RunFolder

__all__ = ["TRACKERS", "missing", "open_trackers", "Tracker", "TrackerError"]

# Tracker name -> the package it needs (what `pip install` takes, and imports).
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
DEFAULT_PROJECT = "rcgrpo"  # W&B project / MLflow experiment when the environment names none


class TrackerError(UserError, RuntimeError):
    """A chosen tracker could not start (the message names it)."""


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def missing(names: Sequence[str]) -> list[str]:
    """The trackers among `names` whose package is not installed."""
    return [n for n in names if n in TRACKERS and importlib.util.find_spec(TRACKERS[n]) is None]


def _flat(table: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


class TensorBoard:
    def __init__(self, run_dir: Path, stage: str, resume_step: Optional[int], **_):
        from torch.utils.tensorboard import SummaryWriter

        # One folder per stage: purge_step then only rewinds this stage.
        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(log_dir=str(RunFolder(run_dir).tensorboard(stage)), purge_step=purge)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self._writer.add_scalar(k, v, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandB:
    def __init__(self, run_dir: Path, stage: str, run_name: str, config: dict, **_):
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, dir=str(run_dir),
                               name=f"{run_name}/{stage}", group=run_name, job_type=stage, config=config,
                               reinit="create_new")

    def log(self, scalars: dict[str, float], step: int) -> None:
        # commit: the step is written now, not when a later step arrives
        # (a killed run keeps its last step, as metrics.jsonl does).
        self._run.log(scalars, step=step, commit=True)

    def close(self) -> None:
        self._run.finish()


class MLflow:
    def __init__(self, stage: str, run_name: str, config: dict, **_):
        # The client, not mlflow's module-level active run: two stages (or two
        # loggers in one process) never share a run by accident.
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self._client = client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else client.create_experiment(name)
        run = client.create_run(experiment, run_name=f"{run_name}/{stage}",
                                tags={"rcgrpo.run": run_name, "rcgrpo.stage": stage})
        self._id = run.info.run_id
        params = [Param(k, str(v)[:500]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(self._id, params=params[i:i + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self._client.set_terminated(self._id)


_OPENERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def open_trackers(names: Sequence[str], run_dir: Path, stage: str, resume_step: Optional[int] = None,
                  run_name: Optional[str] = None, config: Optional[dict] = None) -> list[Tracker]:
    """The trackers `names` opened for one stage of the run in `run_dir`."""
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(_OPENERS[name](run_dir=Path(run_dir), stage=stage, resume_step=resume_step,
                                         run_name=run_name or Path(run_dir).name, config=config or {}))
        except Exception as exc:
            for tracker in opened:
                tracker.close()
            raise TrackerError(f"run.report_to {name}: the tracker did not start: {type(exc).__name__}: "
                               f"{exc}") from exc
    return opened
