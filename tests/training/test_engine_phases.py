"""The rollout engine sleeps while the policy updates: per RL step it wakes,
takes the policy's current weights (awake), generates, and goes back to
sleep before the update. A spy around a real (transformers) engine records
the calls of `train_rl` on a tiny model and real BFCL episodes."""
import pytest
import torch

from rcgrpo.config import parse_args
from rcgrpo.policy import TrainablePolicy
from rcgrpo.rollout.engine import awake
from rcgrpo.rollout.hf_engine import HFEngine
from rcgrpo.training.context import RunContext
from rcgrpo.training.grpo import train_rl


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
                      "--run.tensorboard", "false", "--grpo.steps", "2", "--grpo.batch_size", "1",
                      "--grpo.group_size", "2", "--grpo.max_new_tokens", "4", "--grpo.lr", "1e-2",
                      "--grpo.eval_every", "0"],
                     check_files=False)
    ctx = RunContext(cfg, torch.device("cpu"), tokenizer, tiny_folder)
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=True)
    with torch.no_grad():  # unlike its reference: the KL term moves the weights even if every reward is 0
        policy.model.model.norm.weight.mul_(1.5)
    policy.equals_reference = False
    train, _ = split_train_test(load_entries(["base"]))
    spy = SpyEngine(HFEngine(TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"),
                                                  reference=False).model, tokenizer))
    spy.sleep()  # how train.py hands it over: asleep since its start
    spy.calls.clear()
    train_rl(ctx, "rc-grpo", policy, spy, [train[0]], finetune_stage="rctp")

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
