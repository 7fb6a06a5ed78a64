"""The run's one rollout engine, shared by every stage that plays rollouts
(rctp-data, the RL stages, eval), and the settings it is started with."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from rcgrpo import rollout
from rcgrpo.base import distributed
from rcgrpo.config import Config
from rcgrpo.model.loading import folder_weights
from rcgrpo.rollout.engine import awake
from rcgrpo.rollout.vllm_engine import CPU_KV_CACHE_GIB


class RunEngine:
    """The run's one rollout engine: started on first use from a model folder
    (vLLM takes ~20 s to start on CPU) and asleep between rollout phases, so
    that the updates have the accelerator's memory."""

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        self.engine = None
        self.holds: Path | None = None  # the model folder whose weights it holds; None: other weights

    def start(self, model_dir: Path):
        """The engine, started now if it is not yet. Called before a stage's
        policy loads: vLLM reserves its share of the GPU at start and checks
        that it is free."""
        if self.engine is None:
            # Through the package, not a name bound at import: tests trip on rollout.make_engine.
            self.engine = rollout.make_engine(self.cfg.run.engine, model_dir, **engine_kwargs(self.cfg, self.device))
            self.holds = model_dir
            self.engine.sleep()
        return self.engine

    @contextlib.contextmanager
    def phase(self, model_dir: Path):
        """The engine awake for one rollout phase, holding `model_dir`'s weights."""
        engine = self.start(model_dir)
        with awake(engine, None if self.holds == model_dir else folder_weights(model_dir)):
            self.holds = model_dir
            yield engine


def engine_kwargs(cfg: Config, device: torch.device) -> dict:
    if cfg.run.engine == "hf":
        return {}
    kwargs = {"dtype": "float32" if device.type == "cpu" else cfg.model.dtype,
              "max_model_len": cfg.grpo.max_total_tokens, "seed": cfg.data.seed,
              "kv_cache_gib": CPU_KV_CACHE_GIB,
              "gpu_memory_utilization": cfg.run.engine_memory_fraction}
    if distributed.active():
        # Under torchrun every rank builds its own in-process engine on the
        # existing process group (what vLLM calls an external launcher);
        # engine_tp_size consecutive ranks share one tensor-parallel engine.
        kwargs.update(distributed_executor_backend="external_launcher",
                      tensor_parallel_size=cfg.run.engine_tp_size)
    return kwargs
