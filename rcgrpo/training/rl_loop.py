"""The GRPO / RC-GRPO stage's loop: B prompts x G multi-turn rollouts per
step, played by the rollout engine, then one update (rcgrpo.training.rl_update:
group advantages, the clipped loss with KL to the frozen reference, the
optimizer steps), and the new weights pushed into the engine in place at the
next step's rollouts.

RC-GRPO differs from GRPO only in the conditioning of the rollouts: each
rollout draws its own reward token with P(high) = p (the paper, arXiv
2602.03025). GRPO after RCTP conditions every rollout on <|high_reward|>
(what the RCTP policy is asked for at evaluation); GRPO after SFT uses no
token (the rule: rcgrpo.conditioning.reward_tokens.rl_rollout_conditioning).
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import Sequence

from rcgrpo.base import distributed
from rcgrpo.conditioning.reward_tokens import Conditioning
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.rollout.engine import play_awake
from rcgrpo.run.metrics import log_line
from rcgrpo.training.dynamic_sampling import dynamic_sampling
from rcgrpo.training.losses import RLLossSettings
from rcgrpo.training.optimizer import make_optimizer
from rcgrpo.training.parity import ParityOracle
from rcgrpo.training.reward_probe import RewardProbe
from rcgrpo.training.rl_statistics import gather_summaries, group_stats
from rcgrpo.training.rl_update import UpdateSettings, rl_update, to_trajectories
from rcgrpo.training.stage_loop import StageRun, StageSteps, run_stage
from rcgrpo.training.stage_verdict import RL_FIGURES
from rcgrpo.training.step_settings import StepSettings


def prompt_schedule(num_entries: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Entry indices of every step: epochs of seeded shuffles, cut into batches."""
    order: list[int] = []
    epoch = 0
    while len(order) < batch_size * steps:
        idx = list(range(num_entries))
        random.Random(seed * 7_919 + epoch).shuffle(idx)
        order.extend(idx)
        epoch += 1
    return [order[s * batch_size:(s + 1) * batch_size] for s in range(steps)]


def step_share(schedule_row: Sequence[int], tp_size: int) -> tuple[list[int], int, tuple[int, int]]:
    """This rank's part of one step's prompts (entry indices).

    Returns (the prompts its engine plays, the position of the first of them
    in the step, the [start, end) of those the rank trains on). An engine
    group of `tp_size` ranks plays one slice of the prompts together (a
    tensor-parallel engine answers its ranks' identical calls once); each
    rank then trains on its own whole groups of that slice.
    """
    world, r = distributed.world_size(), distributed.rank()
    start, end = distributed.rank_slice(schedule_row, world // tp_size, r // tp_size)
    played = list(schedule_row[start:end])
    mine = distributed.rank_slice(played, tp_size, r % tp_size)
    return played, start, mine


@dataclasses.dataclass
class RlStep:
    """The RL stage's setup, built once at its start (by `train_rl`), and its
    step function: `rl_step(step)` plays step `step`'s rollouts and updates."""
    stage: str
    policy: TrainablePolicy
    engine: object
    tokenizer: object
    entries: Sequence
    section: object  # cfg.grpo
    conditioning: Conditioning
    schedule: list[list[int]]
    rollout: RolloutConfig  # the stage's rollout settings (rollout_settings); each step varies its seed
    engine_tp_size: int
    how: StepSettings
    settings: RLLossSettings
    update: UpdateSettings
    optimizer: object
    scheduler: object
    parity: ParityOracle

    def __call__(self, step: int) -> dict:
        return train_step(self, step)


@dataclasses.dataclass
class StepRollouts:
    """One step's rollouts, as the update and the step's record need them."""
    trained: list  # this rank's share of the kept rollouts (dynamic sampling's, else the scheduled)
    scheduled: list  # this rank's share of the scheduled prompts' rollouts
    ds_counts: dict
    extra_generated: list  # tokens sampled by each rollout of dynamic sampling's extra draws
    replays: int
    version: int
    offset: int


def play_step(run: RlStep, step: int) -> StepRollouts:
    """The engine wakes, takes the policy's current weights, plays the step's
    rollouts (with dynamic sampling's extra draws) and goes back to sleep."""
    g, seed = run.section, run.how.seed
    played, offset, (lo, hi) = step_share(run.schedule[step], run.engine_tp_size)
    version = run.scheduler.last_epoch
    rollout_cfg = dataclasses.replace(
        run.rollout,
        # The loss settings' temperature, so that the engine samples (and reports
        # log-probs) at exactly the temperature the trainer scores the tokens at.
        temperature=run.settings.temperature,
        # Each engine group's share of the step gets its own seeds.
        seed=seed * 100_003 + step + 1_000_003 * offset, policy_version=version,
    )
    extra_generated = []

    def play(indices, draw, live):
        step_entries = [run.entries[i] for i in indices]
        cfg = dataclasses.replace(rollout_cfg, seed=rollout_cfg.seed + 7_777_777 * draw)
        out = run_episodes(live, run.tokenizer, step_entries, g.group_size, cfg, reward_tokens=run.conditioning)
        if draw:
            extra_generated.extend(sum(r.sampled_mask) for r in out)
        return out

    def phase(live):
        extra_generated.clear()  # a replay starts the phase over
        scheduled = play(played, 0, live)
        if not g.dynamic_sampling:
            return scheduled, scheduled, {}
        kept, counts = dynamic_sampling(
            lambda idx, draw: play(idx, draw, live), played, scheduled, len(run.entries), g.batch_size,
            g.dynamic_sampling_max_draws, seed=seed * 1_000_003 + step)
        return kept, scheduled, counts

    run.policy.eval_mode()
    (rollouts, scheduled, ds_counts), replays = play_awake(
        run.engine, run.policy.rollout_weights, phase, f"[{run.stage}] step {step + 1}'s rollouts", warn=log_line,
        replay=not distributed.active())
    # Dynamic sampling is single-process: its renumbered groups all lie in [lo, hi).
    return StepRollouts([r for r in rollouts if lo <= r.group < hi], [r for r in scheduled if lo <= r.group < hi],
                        ds_counts, extra_generated, replays, version, offset)


def train_step(run: RlStep, step: int) -> dict:
    """One step: its rollouts, its update; the step's record for metrics.jsonl."""
    t0 = time.perf_counter()
    played = play_step(run, step)
    t1 = time.perf_counter()
    stats = rl_update(run.policy, to_trajectories(played.trained), run.how, run.settings, run.update,
                      optimizer=run.optimizer, scheduler=run.scheduler, step=step, parity=run.parity)
    run.policy.eval_mode()
    t2 = time.perf_counter()
    # Reward statistics are those of the scheduled prompts (comparable
    # across pipelines); dynamic sampling's extra draws are counted apart.
    everyone = gather_summaries(played.scheduled, played.offset)
    generated = sum(s.generated for s in everyone) + sum(played.extra_generated)
    return dict(
        **group_stats(everyone), **stats, **played.ds_counts, policy_version=played.version,
        engine_replays=played.replays, rollouts_played=len(everyone) + len(played.extra_generated),
        lr=run.scheduler.get_last_lr()[0], rollout_s=t1 - t0, update_s=t2 - t1,
        tokens_per_s=stats.get("batch_tokens", 0) / max(t2 - t1, 1e-9),
        generated_tokens_per_s=generated / max(t1 - t0, 1e-9),
    )


def train_rl(run: StageRun, stage: str, policy: TrainablePolicy, engine, entries: Sequence, section,
             how: StepSettings, rollout: RolloutConfig, *, tokenizer, conditioning: Conditioning,
             probe: RewardProbe, engine_tp_size: int = 1) -> dict:
    """Run the GRPO / RC-GRPO stage (`section`: cfg.grpo) in place on
    `policy`; resumable. `conditioning` is the rollouts' reward-token rule
    (rl_rollout_conditioning), `rollout` the stage's rollout settings, `probe`
    its learning curve.

    Per step: the engine wakes, takes the policy's current weights (on the
    first step too: it may hold another stage's weights, or a resumed run's
    older ones), plays the step's rollouts and goes back to sleep; then the
    update runs with the accelerator's memory to itself. With dynamic
    sampling, zero-variance groups are dropped and more prompts played
    before the update (`dynamic_sampling`).

    The policy version is the number of optimizer steps the stage has taken
    (the scheduler's count, so a resumed run continues it); the engine's
    weights carry the version they were pushed at, and every sampled token
    records it.

    With `grpo.eval_every`, the stage's learning curve (`RewardProbe`) is
    measured before the first step (a step-0 record), after every
    `eval_every`-th step and after the last, and logged with that step."""
    g = section
    optimizer, scheduler = make_optimizer(policy, g.lr, g.weight_decay,
                                          g.steps * g.updates_per_batch * g.mini_batches, 0.0)
    settings = RLLossSettings.from_config(g)
    rl_step = RlStep(
        stage, policy, engine, tokenizer, entries, g, conditioning,
        prompt_schedule(len(entries), g.batch_size, g.steps, how.seed), rollout, engine_tp_size, how, settings,
        UpdateSettings.from_config(g, how.seed), optimizer, scheduler,
        ParityOracle(stage, policy, every=how.parity_check_every, path=how.path, temperature=settings.temperature))
    return run_stage(run, StageSteps(stage, g.steps, policy, optimizer, scheduler, rl_step, RL_FIGURES, rl=True,
                                     probe=probe.measure, probe_every=g.eval_every), how.checkpoint_every)
