"""`python -m rcgrpo.train`: the paper's pipeline, stage by stage.

    rctp+rc-grpo (default):  rctp-data -> rctp -> rc-grpo -> eval
    rctp+grpo / sft+grpo / sft+rc-grpo: the baselines of the paper's Table 1/3
    sft+grpo-ds: GRPO with DAPO's dynamic sampling after SFT (the competing remedy)

Each stage reads the previous stage's exported model (runs/<name>/models/<stage>)
and leaves its own; a finished stage is skipped on `--resume`, an unfinished
one continues from its latest good checkpoint. The run ends with the BFCL
table (eval.md / eval.json) and plots (report.md, *.png) in the run folder.
This file only orchestrates: the checks before a run, claiming its folder and
every stage live in rcgrpo.pipeline.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process

from torch.distributed.elastic.multiprocessing.errors import record

from rcgrpo.base import distributed
from rcgrpo.base.errors import run_command
from rcgrpo.config import PIPELINES, Config, save_config
from rcgrpo.config.cli import parse_command_line, run_header
from rcgrpo.model.loading import reward_token_ids
from rcgrpo.pipeline.claim import claim_fresh_run_dir, claimed_run_folder
from rcgrpo.pipeline.engine import RunEngine
from rcgrpo.pipeline.environment import UserEnvironment
from rcgrpo.pipeline.prepare import Prepared, pick_device, prepare, seed_everything, training_entries
from rcgrpo.pipeline.push import push_finished_stage
from rcgrpo.pipeline.resume import check_resume
from rcgrpo.pipeline.run import Run
from rcgrpo.pipeline.stages import STAGES, Stage
from rcgrpo.report.summary import learning_summary, write_report
from rcgrpo.run.lock import RunInUseError
from rcgrpo.run.metrics import log_line, quiet_library_progress, read_records

# What the tests and scripts import from here besides the entry points (each
# lives in rcgrpo.pipeline; tests patch `distributed` and `run` through here).
__all__ = ["main", "run", "prepare", "training_entries", "claim_fresh_run_dir", "push_finished_stage",
           "RunInUseError", "distributed"]


def run(cfg: Config, environment: UserEnvironment | None = None) -> int:
    """The pipeline of `cfg`; `environment`: the Python trainer's objects
    (rcgrpo.trainer), else the config's env section says what to play."""
    seed_everything(cfg.data.seed)
    quiet_library_progress()
    prepared = prepare(cfg, environment)  # every rank checks (the same things), so all of them stop on a problem
    with claimed_run_folder(cfg):
        this_run = open_run(cfg, prepared)
        for stage in (STAGES[name] for name in PIPELINES[cfg.run.pipeline]):
            if not skipped(stage, this_run):
                stage.run(getattr(cfg, stage.section), this_run)
        report(this_run)
    return 0


def open_run(cfg: Config, prepared: Prepared) -> Run:
    """The run's first steps once its folder is held: a resume's changes
    recorded, the config saved, the run's first line."""
    if cfg.run.resume and distributed.is_main():
        check_resume(cfg, write=True)  # checked in prepare; now recorded, with the folder held
    token_ids = list(reward_token_ids(prepared.tokenizer).values())
    if distributed.is_main():
        save_config(cfg, cfg.run_dir)
    log_line(f"run folder {cfg.run_dir}; environment {prepared.environment.description}; "
             f"{len(prepared.entries)} training tasks; stages {cfg.stages}; fused={cfg.run.fused}")
    return Run(cfg, prepared.device, prepared.tokenizer, prepared.base, prepared.entries, token_ids,
               RunEngine(cfg, prepared.device), environment=prepared.environment)


def skipped(stage: Stage, this_run: Run) -> bool:
    """Whether `stage` has nothing to do in this invocation: left out of
    --stages, or finished by an earlier invocation of the run (--resume). A
    finished stage that trains still hands on its policy; one named in
    --stages also gets its Hub push (one that failed before, or one asked
    for now)."""
    # Rank 0's answer: another rank could look after rank 0 marked it.
    done = distributed.broadcast_object(this_run.stage_done(stage.name))
    if stage.name not in this_run.cfg.stages:
        if stage.trains and done:
            this_run.current = this_run.folder.stage_model(stage.name)
        return True
    if not (stage.marks_done and done):
        return False
    log_line(f"[{stage.name}] already done, skipped")
    if stage.trains:
        this_run.current = this_run.folder.stage_model(stage.name)
        push_finished_stage(this_run, stage.name)
    return True


def report(this_run: Run) -> None:
    """The run's last lines (rank 0): what it learnt, its report and plots;
    or, when no stage that logs metrics ran (e.g. --stages rctp-data, which
    is no failure), what its stages produced."""
    if not distributed.is_main():
        return
    folder = this_run.folder
    if folder.metrics.exists():
        written = write_report(folder.path)
        learnt = learning_summary(read_records(folder.metrics)[0])
        print("\n".join(["what it learnt:", *learnt, ""]) if learnt else "", end="")
        print(f"report: {written}\nplots: {', '.join(str(p) for p in folder.plots())}")
    else:
        made = ", ".join(this_run.produced) if this_run.produced else "nothing new (its stages were done already)"
        print(f"done: stages {this_run.cfg.stages} produced {made}; no training stage ran, so no report")


def train_command(argv: list[str]) -> int:
    resolved = parse_command_line(argv)
    cfg = resolved.cfg
    # First, before any work: what this run applies (the preset and why,
    # its size), so that a changed model or file never changes it unseen.
    for line in run_header(resolved, argv):
        log_line(line)
    with distributed.guarded():  # a failing rank names itself and exits non-zero
        distributed.init(pick_device(cfg.run.device).type, cfg.run.dist_timeout_s)
        code = run(cfg)
        distributed.shutdown()
    return code


@record  # under torchrun with --debug: the failing rank's traceback goes into the agent's summary
def main(argv=None) -> int:
    """Errors a user can fix are one line and exit code 2 (rcgrpo.base.errors)."""
    return run_command("rcgrpo.train", train_command, argv)


if __name__ == "__main__":
    sys.exit(main())
