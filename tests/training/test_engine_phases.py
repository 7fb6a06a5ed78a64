"""The rollout engine sleeps while the policy updates: per RL step it wakes,
takes the policy's current weights (awake), generates, and goes back to
sleep before the update. A spy around a real (transformers) engine records
the calls of `train_rl` on a tiny model and real BFCL episodes."""
import dataclasses
import json
import math

import pytest
import torch

from rcgrpo.config import parse_args
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.pipeline.run import Run
from rcgrpo.pipeline.stages import train_rl_stage
from rcgrpo.rollout.engine import EngineFault, Generation, awake, check_generations
from rcgrpo.rollout.hf_engine import HFEngine


class SpyEngine:
    """Delegates to a real engine and records the order of calls; a call that
    needs the engine awake fails loudly when it is asleep."""

    supports_sleep = True
    name = "spy"

    def __init__(self, inner):
        self.inner, self.calls, self.asleep = inner, [], False
        self.swapped = []  # a checksum of each swap's weights

    def wake_up(self):
        self.calls.append("wake_up")
        self.asleep = False

    def sleep(self):
        self.calls.append("sleep")
        self.asleep = True

    def load_weights(self, named):
        assert not self.asleep, "weights swapped into a sleeping engine"
        named = list(named)
        self.calls.append("load_weights")
        self.swapped.append(float(sum(t.double().sum() for _, t in named)))
        self.inner.load_weights(named)

    def generate(self, prompts, sampling):
        assert not self.asleep, "generate() on a sleeping engine"
        if not self.calls or self.calls[-1] != "generate":
            self.calls.append("generate")
        return self.inner.generate(prompts, sampling)


@pytest.mark.slow  # RL steps with generation by the transformers engine (~2.5 s)
def test_each_rl_step_wakes_swaps_generates_and_sleeps_before_the_update(tiny_folder, tokenizer, tmp_path):
    from rcgrpo.envs.bfcl import load_entries, split_train_test

    cfg = parse_args(["--fused", "--out-dir", str(tmp_path), "--name", "phases", "--run.checkpoint_every", "0",
                      "--run.report_to", "none", "--grpo.steps", "2", "--grpo.batch_size", "1",
                      "--grpo.group_size", "2", "--grpo.max_new_tokens", "4", "--grpo.lr", "1e-2",
                      "--grpo.eval_every", "0"],
                     check_files=False)
    ctx = Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=True)
    with torch.no_grad():  # unlike its reference: the KL term moves the weights even if every reward is 0
        policy.model.model.norm.weight.mul_(1.5)
    policy.equals_reference = False
    train, _ = split_train_test(load_entries(["base"]))
    spy = SpyEngine(HFEngine(TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"),
                                                  reference=False).model, tokenizer))
    spy.sleep()  # how train.py hands it over: asleep since its start
    spy.calls.clear()
    train_rl_stage(ctx, "rc-grpo", policy, spy, [train[0]], finetune_stage="rctp")

    phase = ["wake_up", "load_weights", "generate", "sleep"]
    assert spy.calls == phase * 2, spy.calls
    # The second step's swap carries the first update's weights.
    assert len(spy.swapped) == 2 and spy.swapped[0] != spy.swapped[1]


def test_the_engine_goes_back_to_sleep_when_a_phase_fails(tiny_folder, tokenizer):
    spy = SpyEngine(HFEngine(TrainablePolicy.load(tiny_folder, parse_args([], check_files=False).model,
                                                  torch.device("cpu"), reference=False).model, tokenizer))
    with pytest.raises(RuntimeError, match="rollout failed"):
        with awake(spy):
            raise RuntimeError("rollout failed")
    assert spy.calls == ["wake_up", "sleep"] and spy.asleep


class FaultyEngine(SpyEngine):
    """A real engine that returns NaN log-probs in the awake phases listed
    (counted from 1 by wake_up): the fault seen once in the study, which
    cannot be produced on demand."""

    def __init__(self, inner, faulty_phases):
        super().__init__(inner)
        self.faulty_phases, self.phase = set(faulty_phases), 0

    def wake_up(self):
        super().wake_up()
        self.phase += 1

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        if self.phase not in self.faulty_phases:
            return out
        return [[dataclasses.replace(g, logprobs=[math.nan] * len(g.token_ids)) for g in gens] for gens in out]


def test_a_non_finite_log_prob_of_a_sampled_token_is_an_engine_fault():
    check_generations(SpyEngine(None), [[Generation([5, 6], [-0.1, -2.0], "stop"), Generation([5], None, "stop")]])
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(EngineFault, match="non-finite log-prob"):
            check_generations(SpyEngine(None), [[Generation([5, 6], [-0.1, bad], "stop")]])


def _rl_run(tiny_folder, tokenizer, out_dir, engine, steps=2):
    from rcgrpo.envs.bfcl import load_entries, split_train_test

    cfg = parse_args(["--fused", "--out-dir", str(out_dir), "--name", "fault", "--run.checkpoint_every", "0",
                      "--run.report_to", "none", "--grpo.steps", str(steps), "--grpo.batch_size", "1",
                      "--grpo.group_size", "2", "--grpo.max_new_tokens", "4", "--grpo.lr", "1e-2",
                      "--grpo.eval_every", "1", "--grpo.eval_rollouts", "2"], check_files=False)
    ctx = Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=True)
    train, _ = split_train_test(load_entries(["base"]))
    engine.sleep()
    try:
        train_rl_stage(ctx, "rc-grpo", policy, engine, [train[0]], finetune_stage="rctp")
    finally:
        rows = [json.loads(x) for x in (out_dir / "fault" / "metrics.jsonl").read_text().splitlines()]
    return rows, policy


def _engine(tiny_folder, tokenizer, faulty_phases=()):
    model = TrainablePolicy.load(tiny_folder, parse_args([], check_files=False).model, torch.device("cpu"),
                                 reference=False).model
    return FaultyEngine(HFEngine(model, tokenizer), faulty_phases)


@pytest.mark.slow  # two short RL runs of the tiny model with the transformers engine (~5 s)
def test_a_faulty_phase_is_replayed_with_fresh_weights_and_trains_on_what_a_healthy_engine_played(
        tiny_folder, tokenizer, tmp_path):
    """Phases: 1 the step-0 probe, 2 step 1's rollouts, 3 step 1's probe, ...
    A fault in step 1's rollouts and one in its probe: each is played again
    with the weights pushed anew, and the run logs exactly what the clean
    run logs (seeded rollouts), besides the replay counts."""
    clean, clean_policy = _rl_run(tiny_folder, tokenizer, tmp_path / "clean", _engine(tiny_folder, tokenizer))
    engine = _engine(tiny_folder, tokenizer, faulty_phases={2, 4})
    faulted, policy = _rl_run(tiny_folder, tokenizer, tmp_path / "faulted", engine)
    assert engine.calls.count("load_weights") == engine.phase == 7 and engine.asleep  # 5 phases + 2 replays
    step1 = next(r for r in faulted if r["step"] == 1)
    assert step1["engine_replays"] == 1 and step1["probe_engine_replays"] == 1
    ignore = {"time", "rollout_s", "update_s", "tokens_per_s", "generated_tokens_per_s", "engine_replays",
              "probe_engine_replays"}
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ignore} for r in rows]  # noqa: E731
    assert strip(faulted) == strip(clean)
    for a, b in zip(policy.model.parameters(), clean_policy.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow  # a short RL run of the tiny model with the transformers engine (~2 s)
def test_a_fault_that_persists_stops_the_run_in_one_line_and_keeps_what_was_logged(tiny_folder, tokenizer, tmp_path):
    engine = _engine(tiny_folder, tokenizer, faulty_phases={2, 3, 4})
    with pytest.raises(EngineFault) as info:
        _rl_run(tiny_folder, tokenizer, tmp_path, engine)
    message = str(info.value)
    assert "step 1's rollouts" in message and "3 awake phase(s)" in message and "--resume" in message
    assert "\n" not in message and engine.asleep and engine.phase == 4
    rows = [json.loads(x) for x in (tmp_path / "fault" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and rows[0]["probe_engine_replays"] == 0
