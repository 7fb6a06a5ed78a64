"""What every stage of a run shares: config, device, folders, the tokenizer,
and how a stage's model is saved for the next stage."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rcgrpo import distributed
from rcgrpo.checkpoint import load_latest, save_checkpoint
from rcgrpo.config import Config
from rcgrpo.lora import is_lora, save_merged
from rcgrpo.metrics import DiscardingLogger, MetricsLogger, log_line

@dataclass
class RunContext:
    cfg: Config
    device: torch.device
    tokenizer: object
    base_model_dir: Path  # the starting policy (token-extended)

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    def stage_model_dir(self, stage: str) -> Path:
        """Where a finished stage leaves its policy for the next stage."""
        return self.run_dir / "models" / stage

    def stage_done(self, stage: str) -> bool:
        """Written by mark_done after the stage's outputs are in place."""
        return (self.run_dir / "stages" / f"{stage}.done").exists()

    def mark_done(self, stage: str, info: dict) -> None:
        if not distributed.is_main():
            return
        folder = self.run_dir / "stages"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{stage}.done.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        tmp.replace(folder / f"{stage}.done")

    def export_model(self, stage: str, model) -> Path:
        """Save the stage's final policy (safetensors + tokenizer) atomically.
        A LoRA policy is saved merged (the next stage and vLLM load a plain
        model), with its adapter alone in `adapter/` inside the folder."""
        if distributed.is_sharded(model):
            return self._export_gathered(stage, model)
        if is_lora(model):
            return self._replace_model_dir(stage, lambda tmp: save_merged(model, tmp))
        return self._replace_model_dir(stage, lambda tmp: model.save_pretrained(tmp, safe_serialization=True))

    def _export_gathered(self, stage: str, model) -> Path:
        """FSDP: every rank joins the gather, rank 0 writes the same plain
        folder one process writes, and no rank goes on before it exists."""
        from rcgrpo.training.sharded_state import gathered_model_state

        state = gathered_model_state(model)
        if distributed.is_main():
            self._replace_model_dir(
                stage, lambda tmp: model.save_pretrained(tmp, safe_serialization=True, state_dict=state))
        distributed.barrier()
        return self.stage_model_dir(stage)

    def _replace_model_dir(self, stage: str, write_model) -> Path:
        """`write_model(tmp)` plus the tokenizer into a temporary sibling, then
        swapped in for the stage's folder: a reader never sees half a model."""
        final = self.stage_model_dir(stage)
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        write_model(tmp)
        self.tokenizer.save_pretrained(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def checkpoint_root(self, stage: str) -> Path:
        return self.run_dir / "checkpoints" / stage

    def save(self, stage: str, step: int, model, optimizer, scheduler) -> None:
        """Every rank calls; rank 0 writes (see sharded_state for the format)."""
        states = {}
        if distributed.is_sharded(model):
            from rcgrpo.training.sharded_state import gathered_model_state, gathered_optimizer_state

            states = {"model_state_dict": gathered_model_state(model),
                      "optimizer_state_dict": gathered_optimizer_state(model, optimizer)}
        if distributed.is_main():
            save_checkpoint(
                self.checkpoint_root(stage), step, model, self.tokenizer, optimizer, scheduler,
                stage=stage, data_position=step, config=self.cfg.to_dict(),
                keep_last=self.cfg.run.keep_last, **states,
            )

    def resume(self, stage: str, model, optimizer, scheduler) -> int:
        """The step restored from the latest good checkpoint of this stage
        (0 for a fresh start). Data order is a pure function of the seed, so
        the step is also the data position. Under torchrun rank 0 picks and
        verifies the checkpoint and hands its state to the other ranks."""
        if not self.cfg.run.resume:
            return 0
        ckpt = load_latest(self.checkpoint_root(stage)) if distributed.is_main() else None
        if distributed.is_sharded(model):
            from rcgrpo.training.sharded_state import restore_sharded

            ckpt = restore_sharded(ckpt, model, optimizer, scheduler)
        elif ckpt is not None:
            ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler)
        if ckpt is None:
            return 0
        log_line(f"[{stage}] resumed from {ckpt.path} (step {ckpt.step})")
        return ckpt.step

    def metrics(self, stage: str, resume_step: int | None) -> MetricsLogger:
        if not distributed.is_main():
            return DiscardingLogger()  # one writer: rank 0 logs the reduced metrics
        return MetricsLogger(self.run_dir, stage=stage, resume_step=resume_step,
                             tensorboard=self.cfg.run.tensorboard)


def make_optimizer(model, lr: float, weight_decay: float, total_steps: int, warmup_ratio: float):
    """AdamW (the paper's optimizer for SFT; our choice for the RL stages) and
    a linear warm-up to a constant rate."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def clip_and_step(model, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip to the global gradient norm and step. With FSDP the gradients are
    DTensor shards: torch's norm of them is the norm over all ranks (the
    same number on every rank), returned as a DTensor and read out whole."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    elif distributed.is_sharded(model):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])) if params else torch.zeros(())
    norm = distributed.full_tensor(norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
