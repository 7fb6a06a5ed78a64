"""`python -m rcgrpo.train`: the paper's pipeline, stage by stage.

    rctp+rc-grpo (default):  rctp-data -> rctp -> rc-grpo -> eval
    rctp+grpo / sft+grpo / sft+rc-grpo: the baselines of the paper's Table 1/3

Each stage reads the previous stage's exported model (runs/<name>/models/<stage>)
and leaves its own; a finished stage is skipped on `--resume`, an unfinished
one continues from its latest good checkpoint. The run ends with the BFCL
table (eval.md / eval.json) and plots (report.md, *.png) in the run folder.
This file only orchestrates: every stage lives in its own module.
"""
from __future__ import annotations

import os
import random
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process

import numpy as np
import torch

from torch.distributed.elastic.multiprocessing.errors import record

from rcgrpo import distributed
from rcgrpo.config import PIPELINES, Config, ConfigError, parse_args


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
    `data.max_prompt_tokens`, optionally a seeded subset."""
    from rcgrpo.envs.bfcl import Episode, load_entries, split_train_test
    from rcgrpo.evaluate import named_entries
    from rcgrpo.prompts import ChatTokens, initial_messages

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
        raise SystemExit(f"data.entry_ids: {too_long} have prompts over data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if not fitting:
        raise SystemExit(f"no training entry has a prompt under data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if cfg.data.train_subset is not None and cfg.data.train_subset < len(fitting):
        fitting = sorted(random.Random(cfg.data.seed).sample(fitting, cfg.data.train_subset), key=lambda e: e.id)
    return fitting


def claim_fresh_run_dir(cfg: Config) -> None:
    """A new run never writes into an existing run's folder: it takes the
    first free `<name>-2`, `<name>-3`, ... (`--resume` continues the named one)."""
    from rcgrpo.metrics import log_line

    base, k = cfg.run.name, 1
    while cfg.run_dir.exists() and any(cfg.run_dir.iterdir()):
        k += 1
        cfg.run.name = f"{base}-{k}"
    if k > 1:
        log_line(f"runs/{base} exists: this run uses {cfg.run_dir} (pass --resume to continue {base})")


def run(cfg: Config) -> int:
    from rcgrpo.data.rctp import build_rctp, expert_records, load_records, save_records, summary
    from rcgrpo.evaluate import evaluate, select_entries, write_eval
    from rcgrpo.metrics import log_line
    from rcgrpo.models import load_policy, load_tokenizer, resolve_model_folder
    from rcgrpo.report import write_report
    from rcgrpo.rollout import make_engine
    from rcgrpo.rollout.agent_loop import RolloutConfig
    from rcgrpo.training.context import RunContext
    from rcgrpo.training.finetune import finetune
    from rcgrpo.training.grpo import train_rl
    from rcgrpo.training.weight_sync import rollout_weights

    seed_everything(cfg.data.seed)
    if not cfg.run.resume:
        if distributed.is_main():
            claim_fresh_run_dir(cfg)
        cfg.run.name = distributed.broadcast_object(cfg.run.name)
    device = pick_device(cfg.run.device)
    dtype = getattr(torch, cfg.model.dtype)
    base = resolve_model_folder(cfg.model.name_or_path)
    tokenizer = load_tokenizer(base)
    ctx = RunContext(cfg, device, tokenizer, base)
    if distributed.is_main():
        cfg.save(ctx.run_dir)
    entries = training_entries(cfg, tokenizer)
    log_line(f"run folder {ctx.run_dir}; {len(entries)} training entries; stages {cfg.stages}; fused={cfg.run.fused}")

    engines = []

    def engine_with(model_dir, weights=None):
        """The one rollout engine of the run, started on first use (vLLM
        takes ~20 s to start on CPU) and holding `weights` afterwards."""
        if not engines:
            engines.append(make_engine(cfg.run.engine, model_dir, **engine_kwargs(cfg, device)))
        elif weights is not None:
            engines[0].load_weights(weights)
        return engines[0]

    current = base  # the policy the next stage starts from
    data_path = ctx.run_dir / "rctp_data.jsonl"
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
            continue
        if stage == "rctp-data":
            if cfg.rctp.data_file:
                records = load_records(cfg.rctp.data_file)
            else:
                # Every rank starts its engine (vLLM's process groups form
                # collectively); rank 0 alone builds the set, the others wait.
                engine = engine_with(current)
                records = build_rctp(engine, entries, tokenizer, rollout_cfg, cfg.rctp.failure_ratio,
                                     cfg.rctp.failure_attempts, cfg.rctp.fill_with_perturbed,
                                     cfg.data.seed) if distributed.is_main() else []
            if distributed.is_main():
                save_records(records, data_path)
                ctx.mark_done(stage, summary(records))
                log_line(f"[rctp-data] {summary(records)} -> {data_path}")
            distributed.barrier()
        elif stage in ("rctp", "sft"):
            policy = load_policy(current, dtype=dtype, device=device)
            if stage == "rctp":
                source = data_path if data_path.exists() or not cfg.rctp.data_file else cfg.rctp.data_file
                trajectories = [r.trajectory() for r in load_records(source)]
            else:
                trajectories = [r.trajectory() for r in expert_records(entries, tokenizer, rollout_cfg, tagged=False)]
            section = cfg.rctp if stage == "rctp" else cfg.sft
            model = sharded(trainable(cfg, policy.model))
            finetune(ctx, stage, model, trajectories, section)
            current = ctx.export_model(stage, model)
            ctx.mark_done(stage, {"trajectories": len(trajectories)})
            del policy, model
        elif stage in ("grpo", "rc-grpo"):
            policy = load_policy(current, dtype=dtype, device=device)
            model = sharded(trainable(cfg, policy.model))
            # LoRA: the reference is the same model with its adapters off
            # (reference_logprobs switches them), not a second copy.
            ref = model if cfg.model.lora.enabled else sharded(
                load_policy(current, dtype=dtype, device=device).model.eval().requires_grad_(False))
            engine = engine_with(current, rollout_weights(model))
            train_rl(ctx, stage, model, ref, engine, entries,
                     reward_conditioned=cfg.finetune_stage == "rctp")
            current = ctx.export_model(stage, model)
            ctx.mark_done(stage, {"steps": cfg.grpo.steps})
            del policy, model, ref
        elif stage == "eval":
            policy = load_policy(current, dtype=dtype, device="cpu")
            engine = engine_with(current, rollout_weights(policy.model))
            del policy
            if not distributed.is_main():
                continue  # rank 0 evaluates; the others only held their engines alongside
            test = select_entries(cfg.eval.split, cfg.eval.categories, cfg.eval.subset)
            result = evaluate(engine, tokenizer, test, cfg.eval.conditioning, cfg.eval.greedy,
                              cfg.eval.max_new_tokens, cfg.grpo.max_total_tokens, cfg.grpo.temperature,
                              cfg.data.seed, cfg.data.doc_style)
            _, md_path = write_eval(result, ctx.run_dir, cfg.run.pipeline)
            print(md_path.read_text())
    if distributed.is_main():
        report = write_report(ctx.run_dir)
        print(f"report: {report}\nplots: {', '.join(str(p) for p in sorted(ctx.run_dir.glob('*.png')))}")
    return 0


def sharded(model):
    """Under torchrun, the model as FSDP2 shards over the ranks; else as is."""
    return distributed.shard_model(model) if distributed.active() else model


def trainable(cfg: Config, model):
    """The model a training stage updates: the policy, or with model.lora.enabled
    the policy wrapped with LoRA adapters (only they train)."""
    if not cfg.model.lora.enabled:
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        return model
    from rcgrpo.lora import wrap

    return wrap(model, cfg.model.lora, cfg.model.gradient_checkpointing)


def engine_kwargs(cfg: Config, device: torch.device) -> dict:
    if cfg.run.engine == "hf":
        return {}
    kwargs = {"dtype": "float32" if device.type == "cpu" else cfg.model.dtype,
              "max_model_len": cfg.grpo.max_total_tokens, "seed": cfg.data.seed, "kv_cache_gib": 2}
    if distributed.active():
        # Under torchrun every rank builds its own in-process engine on the
        # existing process group (what vLLM calls an external launcher);
        # engine_tp_size consecutive ranks share one tensor-parallel engine.
        kwargs.update(distributed_executor_backend="external_launcher",
                      tensor_parallel_size=cfg.run.engine_tp_size)
    return kwargs


@record  # under torchrun: the failing rank's traceback goes into the agent's summary
def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    with distributed.guarded():  # a failing rank names itself and exits non-zero
        distributed.init(pick_device(cfg.run.device).type, cfg.run.dist_timeout_s)
        code = run(cfg)
        distributed.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
