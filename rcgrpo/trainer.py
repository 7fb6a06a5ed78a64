"""The Python trainer, for people who already write TRL's GRPOTrainer:

    from rcgrpo import RCGRPOTrainer, RCGRPOConfig

    args = RCGRPOConfig(preset="cpu-small", output_dir="runs/mine", rctp={"epochs": 1},
                        grpo={"steps": 2, "group_size": 2})
    trainer = RCGRPOTrainer(model="embedded:smollm2-135m-instruct", args=args, train_dataset=train,
                            eval_dataset=test, environment_factory=MyEnv, tools=[...], reward_funcs=[...])
    folder = trainer.train()   # rctp-data -> rctp -> rc-grpo -> eval; returns the run folder

`RCGRPOConfig` is the command line's settings: the same sections and names
(`python -m rcgrpo.train --help` lists them), the same presets and the same
checks, and one rule for defaults in both: without `preset`, the default
preset (cpu-small) applies, as a bare `rcgrpo-train` does; `preset="none"`
gives the bare defaults (the paper's numbers). The environment objects are
TRL's contract (rcgrpo.envs.tool_env). A script that trains must guard its
entry (`if __name__ == "__main__":`): the colocated vLLM engine lives in the
calling process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from rcgrpo import train as _train
from rcgrpo.base import distributed
from rcgrpo.config import Config
from rcgrpo.config.io import apply_settings
from rcgrpo.config.presets import DEFAULT_PRESET, PRESETS
from rcgrpo.config.schema import ConfigError
from rcgrpo.config.validation import finalize
from rcgrpo.pipeline.environment import PYTHON_PREFIX, UserEnvironment
from rcgrpo.pipeline.prepare import pick_device

__all__ = ["RCGRPOConfig", "RCGRPOTrainer"]


def RCGRPOConfig(preset: str | None = DEFAULT_PRESET, output_dir: str | Path | None = None,
                 **sections: dict) -> Config:  # noqa: N802 (named like the class TRL users know)
    """A validated Config: `preset` first (None or "none": no preset), then each
    section's settings (`grpo={"steps": 2}`, or dotted keys `**{"grpo.steps": 2}`),
    `output_dir` the run's folder (TRL's name for run.out_dir / run.name).
    Raises ConfigError on an unknown or impossible setting, as the command line does."""
    cfg = Config()
    if preset not in (None, "none"):
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; the presets are {', '.join(PRESETS)} (none = no preset)")
        apply_settings(cfg, PRESETS[preset], f"preset {preset}")
        cfg.preset = preset
    for section, values in sections.items():
        apply_settings(cfg, {section: values}, "RCGRPOConfig")
    if output_dir is not None:
        folder = Path(output_dir)
        cfg.run.out_dir, cfg.run.name = str(folder.parent), folder.name
    return finalize(cfg)


class RCGRPOTrainer:
    """RCTP then RC-GRPO (or the pipeline `args.run.pipeline` names) on the
    user's environment; `train()` runs it and returns the run folder."""

    def __init__(self, model: str | Path | None = None, args: Config | None = None, *,
                 train_dataset: Any = None, eval_dataset: Any = None,
                 environment_factory: Callable[[], Any] | None = None, tools: Sequence[Callable] | None = None,
                 reward_funcs: Callable | Sequence[Callable] | None = None,
                 reward_weights: Sequence[float] | None = None):
        self.args = args if args is not None else RCGRPOConfig()
        if model is not None:
            apply_settings(self.args, {"model": {"name_or_path": str(model)}}, "RCGRPOTrainer(model=...)")
            finalize(self.args)
        if callable(reward_funcs):
            reward_funcs = [reward_funcs]
        self.environment = None
        if environment_factory is not None or tools or reward_funcs or train_dataset is not None:
            self.environment = UserEnvironment(environment_factory, list(tools or []), list(reward_funcs or []),
                                               reward_weights, train_dataset, eval_dataset)
            # The run's config.toml records what it played (a name, not something to import).
            apply_settings(self.args, {"env": {"name": PYTHON_PREFIX + self.environment.name}},
                           "RCGRPOTrainer(environment_factory=...)")

    def train(self) -> Path:
        """Run the pipeline (resumable with args.run.resume); the run folder."""
        cfg = self.args
        with distributed.guarded():
            distributed.init(pick_device(cfg.run.device).type, cfg.run.dist_timeout_s)
            _train.run(cfg, self.environment)
            distributed.shutdown()
        return cfg.run_dir
