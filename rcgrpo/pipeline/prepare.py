"""Every check a run makes before it claims a run folder: the device, a
refused resume, a Hub repo to push to, the memory plan, the model folder, the
training entries and the RCTP data a stage will read (the model's shape:
rcgrpo.model.shape; the plan: rcgrpo.training.memory_plan). A problem found here
leaves no folder behind and no weights loaded (only the tokenizer)."""
from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import numpy as np
import torch

from rcgrpo.base import distributed, host
from rcgrpo.base.errors import UserError
from rcgrpo.base.stages import RL_STAGES, TRAINED_STAGES
from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
from rcgrpo.config import PIPELINES, Config
from rcgrpo.data.rctp import load_records
from rcgrpo.envs.bfcl import Episode, load_entries, split_train_test
from rcgrpo.evaluation.rollouts import named_entries
from rcgrpo.model.hub import check_push
from rcgrpo.model.loading import load_tokenizer, resolve_model_folder
from rcgrpo.model.shape import model_shape
from rcgrpo.pipeline.environment import (
    RunEnvironment,
    UserEnvironment,
    run_environment,
    tool_evaluation_tasks,
    tool_training_tasks,
)
from rcgrpo.pipeline.resume import check_resume
from rcgrpo.run.folder import RunFolder
from rcgrpo.run.lock import holder_of, in_use
from rcgrpo.training.memory_plan import check_stage, plan_stage


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_entries(cfg: Config, tokenizer, environment: RunEnvironment | None = None) -> list:
    """The run's training tasks. BFCL: the training split of the configured
    categories whose opening prompt fits `data.max_prompt_tokens`: the named
    `data.entry_ids` (all of them), else optionally a seeded subset of
    `data.train_subset`. Another environment: its data set's rows
    (rcgrpo.pipeline.environment.tool_training_tasks)."""
    if environment is not None and not environment.is_bfcl:
        return tool_training_tasks(cfg, tokenizer, environment)
    train, _ = split_train_test(load_entries(cfg.data.categories))
    if cfg.data.entry_ids is not None:
        train = named_entries(train, cfg.data.entry_ids, "data.entry_ids",
                              f"training entries of categories {cfg.data.categories}")
    chat = ChatTokens(tokenizer)
    fitting = [
        e for e in train
        if len(chat.prompt_ids(initial_messages(Episode(e), None, cfg.data.doc_style))) <= cfg.data.max_prompt_tokens
    ]
    if cfg.data.entry_ids is not None and len(fitting) < len(train):
        too_long = sorted({e.id for e in train} - {e.id for e in fitting})
        raise SystemExit(f"data.entry_ids: {too_long} have prompts over "
                         f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if not fitting:
        raise SystemExit(f"no training entry has a prompt under data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if cfg.data.entry_ids is None and cfg.data.train_subset is not None and cfg.data.train_subset < len(fitting):
        fitting = sorted(random.Random(cfg.data.seed).sample(fitting, cfg.data.train_subset), key=lambda e: e.id)
    return fitting


@dataclasses.dataclass
class Prepared:
    """What a run needs before its folder is claimed, each part checked: the
    device, the starting model's folder and tokenizer, the training entries."""

    device: torch.device
    base: Path
    tokenizer: object
    entries: list
    environment: RunEnvironment = dataclasses.field(default_factory=RunEnvironment)


def prepare(cfg: Config, given: UserEnvironment | None = None) -> Prepared:
    """Every check that needs no run folder, before one is claimed: a refused
    resume, the environment (`given`: the Python trainer's objects), the memory
    plan, the model folder, the training tasks and the evaluation tasks, a
    given RCTP data file (each token id an id of the tokenizer)."""
    # First: no other check matters while another run writes there. Rank 0
    # alone looks (it claims the folder; a peer looking later would find
    # rank 0 itself holding it).
    holder = holder_of(cfg.run_dir) if distributed.is_main() else None
    if holder is not None:
        raise in_use(cfg.run_dir, holder)
    if cfg.run.resume:
        check_resume(cfg, write=False)  # recorded once the folder is held (rcgrpo.train.open_run)
    if cfg.run.push_to_hub and distributed.is_main():
        check_push(cfg.run.push_to_hub)  # a token and the repo, before hours of training
    environment = run_environment(cfg, given)  # imports and probes the user's code: fails before any load
    device = pick_device(cfg.run.device)
    shape = model_shape(cfg.model.name_or_path)
    if shape is not None:
        check_memory_plan(cfg, device, shape)
    base = resolve_model_folder(cfg.model.name_or_path)
    if shape is None:
        shape = model_shape(cfg.model.name_or_path, resolved=base)
        check_memory_plan(cfg, device, shape)
    tokenizer = load_tokenizer(base)
    if not environment.is_bfcl:
        environment.tool_env.bind(tokenizer)
        if "eval" in cfg.stages:
            # Every row checked now, not after training; the eval stage plays these.
            environment.eval_tasks = tool_evaluation_tasks(environment, cfg.eval.subset)
    entries = training_entries(cfg, tokenizer, environment)
    check_memory_plan(cfg, device, shape, rctp_entries=len(entries))
    check_rctp_data(cfg, vocab_size=len(tokenizer))
    return Prepared(device, base, tokenizer, entries, environment)


def check_rctp_data(cfg: Config, vocab_size: int) -> None:
    """The RCTP set a stage of this invocation reads, read through once (each
    token id an id of the tokenizer): a given file, else the one a resumed
    run's rctp-data stage left in its folder."""
    if cfg.rctp.data_file and {"rctp-data", "rctp"} & set(cfg.stages):
        load_records(cfg.rctp.data_file, vocab_size=vocab_size)
    elif "rctp" in cfg.stages and "rctp-data" not in cfg.stages:
        own = RunFolder(cfg.run_dir).rctp_data
        if not (cfg.run.resume and own.is_file()):
            raise UserError(f"run.stages: rctp needs the RCTP data set, and {own} does not exist: add rctp-data "
                            "to --stages, or give --rctp.data_file")
        load_records(own, vocab_size=vocab_size)


def rctp_data_needs_engine(rctp) -> bool:
    """Whether building the RCTP set (`rctp`: the config's rctp section) plays
    rollouts (references with near misses, and a given data file, need no engine)."""
    return not rctp.data_file and (rctp.failure_source != "near_miss" or rctp.expert_source == "rollouts")


def check_memory_plan(cfg: Config, device: torch.device, shape, rctp_entries: int | None = None) -> None:
    """Refuse, before any weights load, a training stage that cannot fit the
    device (rcgrpo.training.memory_plan: weights, gradients, AdamW state, reference,
    activations and the engine's share, per rank; an RL stage's rollouts),
    naming the ways out. With `rctp_entries` (known once the training entries
    are), the rctp-data stage instead, whose rollouts of the starting model
    are held at once: rctp_entries x rctp.failure_attempts."""
    pipeline = PIPELINES[cfg.run.pipeline]
    # Through the module, not a name bound at import: tests replace host.device_memory_bytes.
    device_bytes = host.device_memory_bytes(device)
    # On a GPU the rollouts are held in the host's memory (on CPU it is the device).
    host_bytes = host.device_memory_bytes("cpu") if device.type == "cuda" else 0
    builds_with_engine = "rctp-data" in cfg.stages and rctp_data_needs_engine(cfg.rctp)
    if rctp_entries is None:
        stages = [s for s in cfg.stages if s in TRAINED_STAGES]
    else:
        stages = ["rctp-data"] if builds_with_engine else []
    for stage in stages:
        earlier = pipeline[:pipeline.index(stage)]
        # The run's one engine lives on once a stage started it.
        engine_alive = stage in RL_STAGES or ("rctp-data" in earlier and builds_with_engine)
        check_stage(plan_stage(
            shape, cfg, stage, world_size=distributed.world_size(),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), device_type=device.type,
            device_bytes=device_bytes, engine_alive=engine_alive, host_bytes=host_bytes,
            rctp_entries=rctp_entries or 0))
