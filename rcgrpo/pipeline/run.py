"""The run: what the stages of one invocation share (config, device,
tokenizer, folder, training entries, the one rollout engine, the
environment) and what they hand on (the policy the next stage starts from,
`current`, and what each left, `produced`). The pipeline builds it once; a
training stage's loop sees only its narrow face (rcgrpo.training.stage_loop.
StageRun: resume, save, metrics)."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from rcgrpo.base import distributed
from rcgrpo.base.atomic import atomic_write_text
from rcgrpo.config import Config
from rcgrpo.model.loading import added_reward_tokens
from rcgrpo.model.lora import ADAPTER_DIR
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.model.sharing import make_shareable
from rcgrpo.pipeline.engine import RunEngine
from rcgrpo.pipeline.environment import RunEnvironment
from rcgrpo.pipeline.push import push_finished_stage
from rcgrpo.run.checkpoint import SaveError, load_latest, save_checkpoint, write_failure
from rcgrpo.run.folder import RunFolder
from rcgrpo.run.metrics import DiscardingLogger, MetricsLogger, log_line
from rcgrpo.training.step_settings import StepSettings


@dataclasses.dataclass
class Run:
    """One invocation's run (module docstring): built by rcgrpo.train.open_run,
    or by hand with the first four fields for a stage run alone."""

    cfg: Config
    device: torch.device
    tokenizer: object
    base_model_dir: Path  # the starting policy (token-extended)
    entries: list = dataclasses.field(default_factory=list)  # the training entries
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the reward tokens' ids
    engine: RunEngine | None = None
    current: Path | None = None  # where the next stage starts: the base until a stage hands on
    environment: RunEnvironment = dataclasses.field(default_factory=RunEnvironment)
    produced: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.current is None:
            self.current = self.base_model_dir

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    @property
    def folder(self) -> RunFolder:
        return RunFolder(self.cfg.run_dir)

    @property
    def success_threshold(self) -> float:
        """The reward a success reaches (RCTP's high label): BFCL's 1, else env.success_threshold."""
        return 1.0 if self.environment.is_bfcl else self.environment.tool_env.success_threshold

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def step_settings(self) -> StepSettings:
        """What a training stage's steps read of the run (rcgrpo.training.step_settings)."""
        return StepSettings.from_config(self.cfg, self.device)

    def load_policy(self, reference: bool) -> TrainablePolicy:
        """The policy the next stage starts from (`current`)."""
        return TrainablePolicy.load(self.current, self.cfg.model, self.device, reference=reference,
                                    token_ids=self.token_ids)

    def hand_on(self, stage: str, policy: TrainablePolicy, info: dict) -> None:
        """A trained stage's last step: its policy exported where the next
        stage starts, the stage marked done, pushed to the Hub if asked."""
        self.current = self.export_model(stage, policy, start=self.current)
        self.mark_done(stage, info)
        push_finished_stage(self, stage)
        self.produced.append(str(self.current))

    def stage_model_dir(self, stage: str) -> Path:
        """Where a finished stage leaves its policy for the next stage."""
        return self.folder.stage_model(stage)

    def stage_done(self, stage: str) -> bool:
        """Written by mark_done after the stage's outputs are in place."""
        return self.folder.done_marker(stage).exists()

    def mark_done(self, stage: str, info: dict) -> None:
        if not distributed.is_main():
            return
        atomic_write_text(self.folder.done_marker(stage), json.dumps(info, indent=1))

    def export_model(self, stage: str, policy: TrainablePolicy, start: Path | None = None) -> Path:
        """Save the stage's final policy (safetensors in `model.export_dtype`
        + tokenizer) atomically; a LoRA policy's adapter as an adapter of the
        user's model (rcgrpo.model.sharing). `start`: the folder the stage started
        from (default: the run's base). Every rank calls; rank 0 writes, and
        no rank goes on before the folder exists (it is what every rank loads next)."""
        dtype = getattr(torch, self.cfg.model.export_dtype)
        if distributed.is_main():
            self._replace_model_dir(stage, lambda tmp: self._write_export(tmp, stage, policy, dtype,
                                                                          start or self.base_model_dir))
        else:
            policy.export(self.stage_model_dir(stage), dtype)  # joins the gathers, writes nothing
        distributed.barrier()
        return self.stage_model_dir(stage)

    def _write_export(self, folder: Path, stage: str, policy: TrainablePolicy, dtype: torch.dtype,
                      start: Path) -> None:
        policy.export(folder, dtype)
        if not policy.lora:
            return
        model_id = self.cfg.model.name_or_path
        why_not = make_shareable(folder / ADAPTER_DIR, stage=stage, model_id=model_id, tokenizer=self.tokenizer,
                                 added_tokens=added_reward_tokens(self.base_model_dir, self.tokenizer),
                                 start=start, base=self.base_model_dir)
        if why_not:
            log_line(f"[{stage}] its adapter is one of {start}, not of {model_id}: {why_not}")

    def _replace_model_dir(self, stage: str, write_model) -> Path:
        """`write_model(tmp)` plus the tokenizer into a temporary sibling, then
        swapped in for the stage's folder: a reader never sees half a model."""
        final = self.stage_model_dir(stage)
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            write_model(tmp)
            self.tokenizer.save_pretrained(tmp)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            reason = write_failure(exc, final.parent)
            if reason is None:
                raise
            # The stage's checkpoints are untouched: a --resume redoes only the export.
            raise SaveError(f"the model of stage {stage} could not be written to {tmp}: {reason} "
                            f"(free space there, then --resume)") from exc
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def checkpoint_root(self, stage: str) -> Path:
        return self.folder.checkpoints(stage)

    def save(self, stage: str, step: int, policy: TrainablePolicy, optimizer, scheduler) -> None:
        """Every rank calls; rank 0 writes (see sharded_state for the format)."""
        states = policy.checkpoint_states(optimizer)
        if distributed.is_main():
            save_checkpoint(
                self.checkpoint_root(stage), step, policy.model, self.tokenizer, optimizer, scheduler,
                stage=stage, data_position=step, config=self.cfg.to_dict(),
                keep_last=self.cfg.run.keep_last, **states,
            )

    def resume(self, stage: str, policy: TrainablePolicy, optimizer, scheduler) -> int:
        """The step restored from the latest good checkpoint of this stage
        (0 for a fresh start). Data order is a pure function of the seed, so
        the step is also the data position. Under torchrun rank 0 picks and
        verifies the checkpoint and hands its state to the other ranks."""
        if not self.cfg.run.resume:
            return 0
        ckpt = load_latest(self.checkpoint_root(stage)) if distributed.is_main() else None
        ckpt = policy.restore(ckpt, optimizer, scheduler)
        if ckpt is None:
            return 0
        log_line(f"[{stage}] resumed from {ckpt.path} (step {ckpt.step})")
        return ckpt.step

    def metrics(self, stage: str, resume_step: int | None) -> MetricsLogger:
        if not distributed.is_main():
            return DiscardingLogger()  # one writer: rank 0 logs the reduced metrics
        return MetricsLogger(self.run_dir, stage=stage, resume_step=resume_step,
                             report_to=self.cfg.run.report_to or (), run_name=self.cfg.run.name,
                             config=self.cfg.to_dict())
