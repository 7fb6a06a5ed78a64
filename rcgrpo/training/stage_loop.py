"""The loop every training stage runs: fine-tuning (rcgrpo.training.finetune)
and RL (rcgrpo.training.rl_loop) are each a setup plus a step function.

    resume -> [step-0 probe] -> for each step: step, probe where due, log,
    tally, progress bar, checkpoint where due -> the stage's summary lines

What a stage leaves (its export, its done marker) is the pipeline's: the
loop sees the run through `StageRun`, the narrow face it needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from rcgrpo.run.metrics import MetricsLogger, log_line, progress
from rcgrpo.training.stage_verdict import StageTally, bar_figures


class StageRun(Protocol):
    """What a training stage's loop asks of the run (rcgrpo.pipeline.run.Run)."""

    def resume(self, stage: str, policy, optimizer, scheduler) -> int: ...

    def save(self, stage: str, step: int, policy, optimizer, scheduler) -> None: ...

    def metrics(self, stage: str, resume_step: int | None) -> MetricsLogger: ...


@dataclass
class StageSteps:
    """One stage's setup, as the loop runs it.

    take_step(step) trains step `step` (from 0) and returns its record;
    probe(step) measures the stage's curve after `step` steps (the steer, the
    sampled reward), before the first step and after every `probe_every`-th
    and the last (no probe: probe_every 0); `figures` are the progress bar's."""
    stage: str
    total_steps: int
    policy: object
    optimizer: object
    scheduler: object
    take_step: Callable[[int], dict]
    figures: tuple
    rl: bool
    probe: Callable[[int], dict] | None = None
    probe_every: int = 0

    def probe_due(self, done: int) -> bool:
        return bool(self.probe and self.probe_every and (done % self.probe_every == 0 or done == self.total_steps))


def run_stage(run: StageRun, steps: StageSteps, checkpoint_every: int) -> dict:
    """Run the stage from its latest checkpoint (resumable); its last step's record."""
    stage, total = steps.stage, steps.total_steps
    start = run.resume(stage, steps.policy, steps.optimizer, steps.scheduler)
    tally, last = StageTally(stage, rl=steps.rl), {}
    with run.metrics(stage, resume_step=start or None) as log:
        if steps.probe_due(0) and start == 0:
            log.log(0, **steps.probe(0))
        bar = progress(range(start, total), total=total, initial=start, desc=stage)
        for step in bar:
            record = steps.take_step(step)
            if steps.probe_due(step + 1):
                record.update(steps.probe(step + 1))
            last = log.log(step + 1, **record)
            tally.add(last)
            bar.set_postfix(bar_figures(last, steps.figures), refresh=False)
            if checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < total:
                run.save(stage, step + 1, steps.policy, steps.optimizer, steps.scheduler)
        bar.close()
    for line in tally.lines():
        log_line(line)
    return last
