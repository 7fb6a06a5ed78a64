"""The stages of the paper's pipeline as objects, each with one entry,
``run(section, context)``: `section` is the part of the config the stage is
about (``cfg.rctp``, ``cfg.sft``, ``cfg.grpo``, ``cfg.eval``), `context` what
the stages of one invocation share and hand on (``rcgrpo.pipeline.run.Run``).
Each stage reads the config here, once, into the settings its loop takes.
``STAGES`` maps each stage name of ``rcgrpo.base.stages`` to its object.

A stage that trains leaves its policy in ``models/<stage>`` and the context's
``current`` pointing there, where the next stage starts; every stage but eval
marks itself done (``stages/<stage>.done``) once its outputs are in place.
"""
from __future__ import annotations

from typing import Callable

from rcgrpo.base import distributed
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD, rl_rollout_conditioning
from rcgrpo.data.divergence import divergences
from rcgrpo.data.rctp import build_rctp, expert_records, load_records, save_records, summary
from rcgrpo.evaluation.rollouts import evaluate, select_entries, write_eval
from rcgrpo.model.loading import load_tokenizer, resolve_model_folder, reward_token_ids
from rcgrpo.pipeline.environment import tool_evaluation_tasks
from rcgrpo.pipeline.prepare import rctp_data_needs_engine
from rcgrpo.pipeline.run import Run
from rcgrpo.rollout import make_engine
from rcgrpo.run.metrics import log_line
from rcgrpo.training.finetune import SteerProbe, finetune
from rcgrpo.training.reward_probe import RewardProbe
from rcgrpo.training.rl_loop import train_rl
from rcgrpo.training.rollout_settings import rollout_settings
from rcgrpo.training.steer import probe_pairs


class Stage:
    """One stage: its name, the config section it reads, whether it leaves a
    policy for the next stage (`trains`) and whether a finished one is
    skipped on --resume (`marks_done`)."""

    section = ""
    trains = True
    marks_done = True

    def __init__(self, name: str):
        self.name = name

    def run(self, section, context: Run) -> None:
        raise NotImplementedError


class RctpDataStage(Stage):
    """RCTP's data set: expert trajectories and the starting model's failures,
    reward-tagged, saved as the run folder's rctp_data.jsonl (or a given
    `rctp.data_file` read and saved there)."""

    section, trains = "rctp", False

    def run(self, section, context: Run) -> None:
        cfg, tokenizer = context.cfg, context.tokenizer
        settings = rollout_settings(cfg, self.name)
        if section.data_file:
            records = load_records(section.data_file, context.vocab_size)
        elif not rctp_data_needs_engine(section):
            records = build_rctp(None, context.entries, tokenizer, settings, section,
                                 cfg.data.seed, context.success_threshold) if distributed.is_main() else []
        else:
            # Every rank starts its engine (vLLM's process groups form
            # collectively); rank 0 alone builds the set, the others wait.
            experts_from = expert_model_engine(section, context) if distributed.is_main() else None
            with context.engine.phase(context.current) as live:
                records = build_rctp(live, context.entries, tokenizer, settings, section, cfg.data.seed,
                                     context.success_threshold, experts_from) if distributed.is_main() else []
        if distributed.is_main():
            data_path = context.folder.rctp_data
            save_records(records, data_path)
            context.mark_done(self.name, summary(records))
            log_line(f"[{self.name}] {summary(records)} -> {data_path}")
            context.produced.append(f"{data_path} ({len(records)} records)")
        distributed.barrier()


def expert_model_engine(section, context: Run):
    """(engine, tokenizer) of `rctp.expert_model`, the stronger model whose
    successes are the experts, or None. The transformers engine: the run's
    vLLM engine is the policy's, and a second one may not share its process."""
    if section.expert_source != "rollouts" or not section.expert_model:
        return None
    folder = resolve_model_folder(section.expert_model)
    return make_engine("hf", folder), load_tokenizer(folder)


def rctp_trajectories(section, context: Run) -> tuple[list, list]:
    """RCTP trains on the reward-tagged set (the run folder's, else the given
    file) and measures its steer on a sample of the set's divergent pairs."""
    own = context.folder.rctp_data
    records = load_records(own if own.exists() or not section.data_file else section.data_file,
                           context.vocab_size)
    trajectories = [r.trajectory() for r in records]
    return trajectories, probe_pairs(divergences(records), section.steer_pairs, context.cfg.data.seed)


def expert_trajectories(section, context: Run) -> tuple[list, list]:
    """SFT trains on the expert trajectories alone, untagged."""
    records = expert_records(context.entries, context.tokenizer, rollout_settings(context.cfg, "sft"), tagged=False,
                             threshold=context.success_threshold)
    return [r.trajectory() for r in records], []


class FinetuneStage(Stage):
    """Supervised fine-tuning of the current policy: RCTP on the tagged set,
    SFT on expert data (`trajectories` gathers which)."""

    def __init__(self, name: str, trajectories: Callable[..., tuple[list, list]]):
        super().__init__(name)
        self.section, self.trajectories = name, trajectories

    def run(self, section, context: Run) -> None:
        trajectories, pairs = self.trajectories(section, context)
        policy = context.load_policy(reference=False)
        tags = reward_token_ids(context.tokenizer)
        # RCTP's section says how often its steer is measured; SFT has no pairs.
        steer_probe = SteerProbe(pairs, tags[HIGH_REWARD], tags[LOW_REWARD], section.steer_every) if pairs else None
        finetune(context, self.name, policy, trajectories, section, context.step_settings(), steer_probe)
        context.hand_on(self.name, policy, {"trajectories": len(trajectories)})


class RlStage(Stage):
    """GRPO / RC-GRPO on the training entries, rollouts from the run's engine."""

    section = "grpo"

    def run(self, section, context: Run) -> None:
        live = context.engine.start(context.current)
        # LoRA: the reference is the same model with its adapters off, not a second copy.
        policy = context.load_policy(reference=section.beta > 0)
        train_rl_stage(context, self.name, policy, live, context.entries, context.cfg.finetune_stage)
        context.engine.holds = None  # the last update's weights were never pushed
        context.hand_on(self.name, policy, {"steps": section.steps})


def train_rl_stage(context: Run, stage: str, policy, engine, entries, finetune_stage: str) -> dict:
    """The RL stage's loop (rcgrpo.training.rl_loop.train_rl) on `policy`,
    with the settings read here from the run's config. `finetune_stage`
    ("rctp" or "sft") is the stage `policy` comes from: with `stage` it
    decides the rollouts' reward tokens (rl_rollout_conditioning)."""
    cfg, section = context.cfg, context.cfg.grpo
    rollout = rollout_settings(cfg, stage)
    probe = RewardProbe(stage, policy, engine, entries, context.tokenizer, rollouts=section.eval_rollouts,
                        config=rollout, finetune_stage=finetune_stage, seed=cfg.data.seed)
    return train_rl(context, stage, policy, engine, entries, section, context.step_settings(), rollout,
                    tokenizer=context.tokenizer, probe=probe, engine_tp_size=cfg.run.engine_tp_size,
                    conditioning=rl_rollout_conditioning(stage, finetune_stage, section.p_high))


class EvalStage(Stage):
    """Accuracy of the current policy, per category (BFCL: the official
    verdict; another environment: reward >= env.success_threshold), in
    eval.json / eval.md, printed. Run again on every invocation that names it."""

    section, trains, marks_done = "eval", False, False

    def run(self, section, context: Run) -> None:
        if context.environment.is_bfcl:
            entries = select_entries(section.split, section.categories, section.subset)
        else:
            entries = context.environment.eval_tasks or tool_evaluation_tasks(context.environment, section.subset)
        # Rank 0 evaluates; the other ranks only hold their engines alongside.
        with context.engine.phase(context.current) as live:
            result = evaluate(live, context.tokenizer, entries, section.conditioning,
                              rollout_settings(context.cfg, self.name)) if distributed.is_main() else None
        if result is not None:
            _, md_path = write_eval(result, context.folder.path, context.cfg.run.pipeline,
                                    context.environment.description)
            print(md_path.read_text())
            context.produced.append(str(md_path))


STAGES: dict[str, Stage] = {
    "rctp-data": RctpDataStage("rctp-data"),
    "sft": FinetuneStage("sft", expert_trajectories),
    "rctp": FinetuneStage("rctp", rctp_trajectories),
    "grpo": RlStage("grpo"),
    "rc-grpo": RlStage("rc-grpo"),
    "eval": EvalStage("eval"),
}
