"""Pushing a finished stage's model to the Hub (`run.push_to_hub`), once."""
from __future__ import annotations

from rcgrpo.base import distributed
from rcgrpo.base.atomic import atomic_write_text
from rcgrpo.model.hub import push_stage
from rcgrpo.run.metrics import log_line


def push_finished_stage(run, stage: str) -> None:
    """Upload a finished stage's export to `run.push_to_hub` once (rank 0),
    recording the commit in the run folder's stages/<stage>.pushed, so that
    a --resume after a failed push pushes it then and a pushed stage is not
    pushed again. `run`: the run (rcgrpo.pipeline.run.Run)."""
    cfg = run.cfg
    if not cfg.run.push_to_hub or not distributed.is_main():
        return
    marker = run.folder.pushed_marker(stage)
    repo = cfg.run.push_to_hub
    if marker.is_file() and marker.read_text().split()[:1] == [repo]:
        return  # pushed to this repo already
    commit = push_stage(repo, run.stage_model_dir(stage), stage, cfg.run.name)
    atomic_write_text(marker, f"{repo} {commit}\n")
    log_line(f"[{stage}] pushed to the Hub: {repo} (this stage: {repo}@{commit})")
