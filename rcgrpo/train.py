"""`python -m rcgrpo.train`: the paper's pipeline, stage by stage.

    rctp+rc-grpo (default):  rctp-data -> rctp -> rc-grpo -> eval
    rctp+grpo / sft+grpo / sft+rc-grpo: the baselines of the paper's Table 1/3
    sft+grpo-ds: GRPO with DAPO's dynamic sampling after SFT (the competing remedy)

Each stage reads the previous stage's exported model (runs/<name>/models/<stage>)
and leaves its own; a finished stage is skipped on `--resume`, an unfinished
one continues from its latest good checkpoint. The run ends with the BFCL
table (eval.md / eval.json) and plots (report.md, *.png) in the run folder.
This file only orchestrates: every stage lives in its own module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from rcgrpo.base import distributed
from rcgrpo.base.errors import UserError, run_command
from rcgrpo.base.stages import FINETUNE_STAGES, RL_STAGES, TRAINED_STAGES
from rcgrpo.config import PIPELINES, Config, save_config
from rcgrpo.config.cli import parse_command_line, run_header
from rcgrpo.run.lock import LOCK_FILE, RunFolderLock, RunInUseError, holder_of, in_use


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_entries(cfg: Config, tokenizer) -> list:
    """Training split of the configured categories whose opening prompt fits
    `data.max_prompt_tokens`: the named `data.entry_ids` (all of them), else
    optionally a seeded subset of `data.train_subset`."""
    from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
    from rcgrpo.envs.bfcl import Episode, load_entries, split_train_test
    from rcgrpo.evaluation.rollouts import named_entries

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


RCTP_DATA = "rctp_data.jsonl"  # the rctp-data stage's output, in the run folder
# What a start writes into its run folder before any stage's work: a folder
# holding nothing else has nothing saved (a start that failed removes it).
BOOKKEEPING = frozenset({LOCK_FILE, "config.toml", "config.json"})


def holds_nothing_saved(folder: Path) -> bool:
    return folder.is_dir() and all(p.name in BOOKKEEPING for p in folder.iterdir())


def claim_fresh_run_dir(cfg: Config) -> None:
    """A new run never writes into an existing run's folder: it takes the
    first free `<name>-2`, `<name>-3`, ... (`--resume` continues the named one)."""
    from rcgrpo.pipeline.resume import SAVED_CONFIG
    from rcgrpo.run.metrics import log_line

    holder = holder_of(cfg.run_dir)
    if holder is not None:
        raise in_use(cfg.run_dir, holder)
    base_dir, base, k = cfg.run_dir, cfg.run.name, 1
    # A folder holding only a lock file (a start that stopped early) is free.
    while cfg.run_dir.exists() and any(p.name != LOCK_FILE for p in cfg.run_dir.iterdir()):
        k += 1
        cfg.run.name = f"{base}-{k}"
    if k > 1:
        # --resume continues only a folder holding a run's saved config.
        hint = (f"pass --resume to continue {base}" if (base_dir / SAVED_CONFIG).is_file()
                else f"{base_dir} holds no run to resume")
        log_line(f"{base_dir} exists: this run uses {cfg.run_dir} ({hint})")


@dataclasses.dataclass
class Prepared:
    """What a run needs before its folder is claimed, each part checked: the
    device, the starting model's folder and tokenizer, the training entries."""

    device: torch.device
    base: Path
    tokenizer: object
    entries: list


def prepare(cfg: Config) -> Prepared:
    """Every check that needs no run folder, before one is claimed: a refused
    resume, the memory plan, the model folder, the training entries, a given
    RCTP data file (each token id an id of the tokenizer). A problem found
    here leaves no folder behind and no weights loaded (only the tokenizer)."""
    from rcgrpo.data.rctp import load_records
    from rcgrpo.model.loading import load_tokenizer, resolve_model_folder
    from rcgrpo.pipeline.resume import check_resume

    # First: no other check matters while another run writes there. Rank 0
    # alone looks (it claims the folder; a peer looking later would find
    # rank 0 itself holding it).
    holder = holder_of(cfg.run_dir) if distributed.is_main() else None
    if holder is not None:
        raise in_use(cfg.run_dir, holder)
    if cfg.run.resume:
        check_resume(cfg, write=False)  # recorded once the folder is held (_run_stages)
    if cfg.run.push_to_hub and distributed.is_main():
        from rcgrpo.model.hub import check_push

        check_push(cfg.run.push_to_hub)  # a token and the repo, before hours of training
    device = pick_device(cfg.run.device)
    shape = model_shape(cfg.model.name_or_path)
    if shape is not None:
        check_memory_plan(cfg, device, shape)
    base = resolve_model_folder(cfg.model.name_or_path)
    if shape is None:
        shape = model_shape(cfg.model.name_or_path, resolved=base)
        check_memory_plan(cfg, device, shape)
    tokenizer = load_tokenizer(base)
    entries = training_entries(cfg, tokenizer)
    check_memory_plan(cfg, device, shape, rctp_entries=len(entries))
    if cfg.rctp.data_file and {"rctp-data", "rctp"} & set(cfg.stages):
        load_records(cfg.rctp.data_file, vocab_size=len(tokenizer))
    elif "rctp" in cfg.stages and "rctp-data" not in cfg.stages:
        # The RCTP stage trains on the set the rctp-data stage left in the run
        # folder (a resumed run's), checked like a given file.
        own = cfg.run_dir / RCTP_DATA
        if not (cfg.run.resume and own.is_file()):
            raise UserError(f"run.stages: rctp needs the RCTP data set, and {own} does not exist: add rctp-data "
                            "to --stages, or give --rctp.data_file")
        load_records(own, vocab_size=len(tokenizer))
    return Prepared(device, base, tokenizer, entries)


def model_shape(name_or_path: str, resolved: Path | None = None):
    """The shapes the memory plan needs, read without loading weights: a
    resolved or local folder's config.json and safetensors headers, else a hub
    model's config.json; None when neither can be read (offline hub id)."""
    from rcgrpo.training.memory_plan import ModelShape

    local = resolved or Path(name_or_path).expanduser()
    if local.is_dir():
        return ModelShape.from_folder(local)
    if name_or_path.startswith("embedded:"):
        return None  # resolved first: a cached conversion, no download
    try:
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(name_or_path).to_dict())
    except Exception:  # offline, private, or not a transformers model: resolving will say which
        return None


PUSHED = "{stage}.pushed"  # in the run's stages/ folder: the commit a stage's export was pushed as


def push_finished_stage(cfg: Config, ctx, stage: str) -> None:
    """Upload a finished stage's export to `run.push_to_hub` once (rank 0),
    recording the commit, so that a --resume after a failed push pushes it
    then and a pushed stage is not pushed again."""
    if not cfg.run.push_to_hub or not distributed.is_main():
        return
    from rcgrpo.base.atomic import atomic_write_text
    from rcgrpo.model.hub import push_stage
    from rcgrpo.run.metrics import log_line

    marker = ctx.run_dir / "stages" / PUSHED.format(stage=stage)
    repo = cfg.run.push_to_hub
    if marker.is_file() and marker.read_text().split()[:1] == [repo]:
        return  # pushed to this repo already
    commit = push_stage(repo, ctx.stage_model_dir(stage), stage, cfg.run.name)
    atomic_write_text(marker, f"{repo} {commit}\n")
    log_line(f"[{stage}] pushed to the Hub: {repo} (this stage: {repo}@{commit})")


def rctp_data_needs_engine(cfg: Config) -> bool:
    """Whether building the RCTP set plays rollouts (near misses and a given
    data file need no engine)."""
    return not cfg.rctp.data_file and cfg.rctp.failure_source != "near_miss"


def check_memory_plan(cfg: Config, device: torch.device, shape, rctp_entries: int | None = None) -> None:
    """Refuse, before any weights load, a training stage that cannot fit the
    device (rcgrpo.training.memory_plan: weights, gradients, AdamW state, reference,
    activations and the engine's share, per rank; an RL stage's rollouts),
    naming the ways out. With `rctp_entries` (known once the training entries
    are), the rctp-data stage instead, whose rollouts of the starting model
    are held at once: rctp_entries x rctp.failure_attempts."""
    from rcgrpo.base.host import device_memory_bytes
    from rcgrpo.training.memory_plan import check_stage, plan_stage

    pipeline = PIPELINES[cfg.run.pipeline]
    device_bytes = device_memory_bytes(device)
    # On a GPU the rollouts are held in the host's memory (on CPU it is the device).
    host_bytes = device_memory_bytes("cpu") if device.type == "cuda" else 0
    if rctp_entries is None:
        stages = [s for s in cfg.stages if s in TRAINED_STAGES]
    else:
        stages = ["rctp-data"] if "rctp-data" in cfg.stages and rctp_data_needs_engine(cfg) else []
    for stage in stages:
        earlier = pipeline[:pipeline.index(stage)]
        # The run's one engine lives on once a stage started it.
        engine_alive = stage in RL_STAGES or (
            "rctp-data" in earlier and "rctp-data" in cfg.stages and rctp_data_needs_engine(cfg))
        check_stage(plan_stage(shape, cfg, stage, world_size=distributed.world_size(),
                               local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                               device_type=device.type, device_bytes=device_bytes, engine_alive=engine_alive,
                               host_bytes=host_bytes, rctp_entries=rctp_entries or 0))


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
            from rcgrpo.rollout import make_engine

            self.engine = make_engine(self.cfg.run.engine, model_dir, **engine_kwargs(self.cfg, self.device))
            self.holds = model_dir
            self.engine.sleep()
        return self.engine

    @contextlib.contextmanager
    def phase(self, model_dir: Path):
        """The engine awake for one rollout phase, holding `model_dir`'s weights."""
        from rcgrpo.rollout.engine import awake
        from rcgrpo.run.checkpoint import folder_weights

        engine = self.start(model_dir)
        with awake(engine, None if self.holds == model_dir else folder_weights(model_dir)):
            self.holds = model_dir
            yield engine


def run(cfg: Config) -> int:
    from rcgrpo.run.metrics import quiet_library_progress

    seed_everything(cfg.data.seed)
    quiet_library_progress()
    prepared = prepare(cfg)  # every rank checks (the same things), so all of them stop on a problem
    # Rank 0 claims the folder and holds its lock for the whole run; every
    # rank learns the name, or the refusal, from it.
    lock, in_use, created = None, None, False
    if distributed.is_main():
        try:
            if not cfg.run.resume:
                claim_fresh_run_dir(cfg)
                created = not cfg.run_dir.exists() or holds_nothing_saved(cfg.run_dir)
            if not cfg.run.resume or cfg.run_dir.is_dir():  # a run to resume that is missing: check_resume says so
                lock = RunFolderLock(cfg.run_dir).acquire()
        except RunInUseError as exc:
            in_use = str(exc)
    cfg.run.name, in_use = distributed.broadcast_object((cfg.run.name, in_use))
    if in_use:
        raise RunInUseError(in_use)
    try:
        return _run_stages(cfg, prepared)
    except BaseException:
        if created and holds_nothing_saved(cfg.run_dir):
            # This start made the folder and saved nothing into it: the retry
            # gets the same name, not <name>-2 beside an empty run. Removed
            # while still locked (every locker is non-blocking, so no one
            # waits on the lock file that goes with it).
            with contextlib.suppress(OSError):  # the failure itself is what to report
                for p in cfg.run_dir.iterdir():
                    p.unlink()
                cfg.run_dir.rmdir()
        raise
    finally:
        if lock is not None:
            lock.release()


def _run_stages(cfg: Config, prepared: Prepared) -> int:
    from rcgrpo.data.divergence import divergences
    from rcgrpo.data.rctp import build_rctp, expert_records, load_records, save_records, summary
    from rcgrpo.evaluation.rollouts import evaluate, select_entries, write_eval
    from rcgrpo.model.loading import reward_token_ids
    from rcgrpo.model.policy import TrainablePolicy
    from rcgrpo.pipeline.resume import check_resume
    from rcgrpo.report.summary import learning_summary, write_report
    from rcgrpo.rollout.agent_loop import RolloutConfig
    from rcgrpo.run.metrics import METRICS_FILE, log_line, read_records
    from rcgrpo.training.context import RunContext
    from rcgrpo.training.finetune import finetune
    from rcgrpo.training.grpo import train_rl
    from rcgrpo.training.steer import probe_pairs

    if cfg.run.resume and distributed.is_main():
        check_resume(cfg, write=True)  # checked in prepare; now recorded, with the folder held
    device, base, tokenizer, entries = prepared.device, prepared.base, prepared.tokenizer, prepared.entries
    token_ids = list(reward_token_ids(tokenizer).values())
    vocab_size = len(tokenizer)
    ctx = RunContext(cfg, device, tokenizer, base)
    if distributed.is_main():
        save_config(cfg, ctx.run_dir)
    produced: list[str] = []  # what this invocation's stages left, for the last line
    log_line(f"run folder {ctx.run_dir}; {len(entries)} training entries; stages {cfg.stages}; fused={cfg.run.fused}")

    engine = RunEngine(cfg, device)
    current = base  # the policy the next stage starts from
    data_path = ctx.run_dir / RCTP_DATA
    rollout_cfg = RolloutConfig(max_new_tokens=cfg.grpo.max_new_tokens, max_total_tokens=cfg.grpo.max_total_tokens,
                                temperature=cfg.rctp.failure_temperature, seed=cfg.data.seed,
                                doc_style=cfg.data.doc_style, progress=True)

    for stage in PIPELINES[cfg.run.pipeline]:
        # Rank 0's answer: another rank could look after rank 0 marked it.
        done = distributed.broadcast_object(ctx.stage_done(stage))
        if stage not in cfg.stages:
            # A stage left out of --stages still hands on its policy if an
            # earlier invocation of this run finished it.
            if stage not in ("rctp-data", "eval") and done:
                current = ctx.stage_model_dir(stage)
            continue
        if stage != "eval" and done:
            log_line(f"[{stage}] already done, skipped")
            if stage != "rctp-data":
                current = ctx.stage_model_dir(stage)
                push_finished_stage(cfg, ctx, stage)  # a push that failed before, or one asked for now
            continue
        if stage == "rctp-data":
            if cfg.rctp.data_file:
                records = load_records(cfg.rctp.data_file, vocab_size)
            elif not rctp_data_needs_engine(cfg):
                records = build_rctp(None, entries, tokenizer, rollout_cfg, cfg.rctp,
                                     cfg.data.seed) if distributed.is_main() else []
            else:
                # Every rank starts its engine (vLLM's process groups form
                # collectively); rank 0 alone builds the set, the others wait.
                with engine.phase(current) as live:
                    records = build_rctp(live, entries, tokenizer, rollout_cfg, cfg.rctp,
                                         cfg.data.seed) if distributed.is_main() else []
            if distributed.is_main():
                save_records(records, data_path)
                ctx.mark_done(stage, summary(records))
                log_line(f"[rctp-data] {summary(records)} -> {data_path}")
                produced.append(f"{data_path} ({len(records)} records)")
            distributed.barrier()
        elif stage in FINETUNE_STAGES:
            pairs = []
            if stage == "rctp":
                source = data_path if data_path.exists() or not cfg.rctp.data_file else cfg.rctp.data_file
                records = load_records(source, vocab_size)
                trajectories = [r.trajectory() for r in records]
                pairs = probe_pairs(divergences(records), cfg.rctp.steer_pairs, cfg.data.seed)
            else:
                trajectories = [r.trajectory() for r in expert_records(entries, tokenizer, rollout_cfg, tagged=False)]
            policy = TrainablePolicy.load(current, cfg.model, device, reference=False, token_ids=token_ids)
            finetune(ctx, stage, policy, trajectories, cfg.rctp if stage == "rctp" else cfg.sft,
                     steer_pairs=pairs, steer_every=cfg.rctp.steer_every)
            current = ctx.export_model(stage, policy, start=current)
            ctx.mark_done(stage, {"trajectories": len(trajectories)})
            push_finished_stage(cfg, ctx, stage)
            produced.append(str(current))
            del policy
        elif stage in RL_STAGES:
            live = engine.start(current)
            # LoRA: the reference is the same model with its adapters off, not a second copy.
            policy = TrainablePolicy.load(current, cfg.model, device, reference=cfg.grpo.beta > 0,
                                          token_ids=token_ids)
            train_rl(ctx, stage, policy, live, entries, finetune_stage=cfg.finetune_stage)
            engine.holds = None  # the last update's weights were never pushed
            current = ctx.export_model(stage, policy, start=current)
            ctx.mark_done(stage, {"steps": cfg.grpo.steps})
            push_finished_stage(cfg, ctx, stage)
            produced.append(str(current))
            del policy
        elif stage == "eval":
            # Rank 0 evaluates; the other ranks only hold their engines alongside.
            with engine.phase(current) as live:
                result = evaluate(live, tokenizer, select_entries(cfg.eval.split, cfg.eval.categories, cfg.eval.subset),
                                  cfg.eval.conditioning, cfg.eval.greedy, cfg.eval.max_new_tokens,
                                  cfg.grpo.max_total_tokens, cfg.grpo.temperature, cfg.data.seed,
                                  cfg.data.doc_style) if distributed.is_main() else None
            if result is not None:
                _, md_path = write_eval(result, ctx.run_dir, cfg.run.pipeline)
                print(md_path.read_text())
                produced.append(str(md_path))
    if distributed.is_main():
        if (ctx.run_dir / METRICS_FILE).exists():
            report = write_report(ctx.run_dir)
            learnt = learning_summary(read_records(ctx.run_dir / METRICS_FILE)[0])
            print("\n".join(["what it learnt:", *learnt, ""]) if learnt else "", end="")
            print(f"report: {report}\nplots: {', '.join(str(p) for p in sorted(ctx.run_dir.glob('*.png')))}")
        else:  # e.g. --stages rctp-data: no stage that logs metrics ran, which is no failure
            made = ", ".join(produced) if produced else "nothing new (its stages were done already)"
            print(f"done: stages {cfg.stages} produced {made}; no training stage ran, so no report")
    return 0


def engine_kwargs(cfg: Config, device: torch.device) -> dict:
    if cfg.run.engine == "hf":
        return {}
    kwargs = {"dtype": "float32" if device.type == "cpu" else cfg.model.dtype,
              "max_model_len": cfg.grpo.max_total_tokens, "seed": cfg.data.seed, "kv_cache_gib": 2,
              "gpu_memory_utilization": cfg.run.engine_memory_fraction}
    if distributed.active():
        # Under torchrun every rank builds its own in-process engine on the
        # existing process group (what vLLM calls an external launcher);
        # engine_tp_size consecutive ranks share one tensor-parallel engine.
        kwargs.update(distributed_executor_backend="external_launcher",
                      tensor_parallel_size=cfg.run.engine_tp_size)
    return kwargs


def train_command(argv: list[str]) -> int:
    from rcgrpo.run.metrics import log_line

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
