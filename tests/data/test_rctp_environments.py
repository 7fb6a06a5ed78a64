"""RCTP data on any environment (rcgrpo/data/rctp.py): experts from the data
set's references with near-miss failures, or from rollouts labelled by the
reward (success iff reward >= the environment's threshold), optionally a
stronger model's, replayed as text under the policy's own template; 1:1."""
import copy
from types import SimpleNamespace

import pytest

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.data.expert import ScriptedEngine
from rcgrpo.data.rctp import RctpDataError, build_rctp
from rcgrpo.envs.tasks import load_tasks
from rcgrpo.envs.tool_env import ToolEnvironment
from rcgrpo.rollout.agent_loop import RolloutConfig
from tests.required import require

CONFIG = RolloutConfig(progress=False, max_new_tokens=128, max_total_tokens=4096)


class Steps:
    """Reward: the fraction of the way to the target (partial credit)."""

    def reset(self, target=0, **row):
        self.total, self.target = 0, target

    def add(self, amount: int) -> str:
        """Add to the running total.

        Args:
            amount: how much to add
        """
        self.total += amount
        return f"total={self.total}"

    def get_reward(self) -> float:
        return min(self.total, self.target) / self.target if self.total <= self.target else 0.0


def rows(reference=True):
    def completion(amounts):
        return [m for a in amounts for m in (
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"amount": a}}}]},
            {"role": "tool", "name": "add", "content": "?"})] + [{"role": "assistant", "content": "done"}]

    return [{"prompt": f"Reach {t}.", "target": t, "id": f"t{t}",
             **({"completion": completion([1, t - 1])} if reference else {})} for t in (4, 6)]


def settings(**kw):
    base = dict(expert_source="reference", failure_source="near_miss", failure_ratio=1.0, failure_attempts=4,
                min_divergence_tokens=8, fill_with_perturbed=True)
    return SimpleNamespace(**{**base, **kw})


def call(amount):
    return '<tool_call>{"name": "add", "arguments": {"amount": %d}}</tool_call>' % amount


def reach(text):
    """The replies that reach the prompt's target in one call."""
    return [call(int(text.split("Reach ")[1].split(".")[0])), "ok"]


class Scripted:
    """Answers each conversation of a batch in turn from `scripts` (one script per rollout, cycled;
    a script is the replies, or a function of the prompt's text giving them)."""

    name, supports_sleep = "scripted", False

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.scripts, self.started = tokenizer, scripts, {}

    def generate(self, prompts, sampling):
        out = []
        for prompt, s in zip(prompts, sampling):
            text = self.tokenizer.decode(prompt)
            key = text.split("assistant\n")[0]  # the prompt, the same for each of a task's rollouts
            replies_so_far = text.count("assistant\n") - 1
            if replies_so_far == 0:
                self.started[key] = self.started.get(key, -1) + 1
            script = self.scripts[self.started[key] % len(self.scripts)]
            script = script(text) if callable(script) else script
            out.append(ScriptedEngine(self.tokenizer, script[replies_so_far:]).generate([prompt], [s])[0])
        return out


def test_references_and_near_misses_labelled_by_the_threshold(tokenizer):
    env = ToolEnvironment(environment_factory=Steps, success_threshold=0.75).bind(tokenizer)
    tasks = load_tasks(rows(), env, "train_dataset")
    records = build_rctp(None, tasks, tokenizer, CONFIG, settings(), seed=0, threshold=0.75)
    experts = [r for r in records if r.kind == "expert"]
    failures = [r for r in records if r.kind == "perturbed"]
    assert len(experts) == len(failures) == 2  # 1:1
    assert all(r.reward == 1.0 and r.reward_token == HIGH_REWARD for r in experts)
    # A near miss is kept only below the threshold: dropping the first call of [1, t-1] leaves 3/4 or 5/6,
    # a success at 0.75, so the kept ones are the other mistakes.
    assert all(r.reward < 0.75 and r.reward_token == LOW_REWARD for r in failures)
    assert all(tokenizer.convert_tokens_to_ids(r.reward_token) in r.token_ids for r in records)


def test_without_references_there_is_no_expert(tokenizer):
    env = ToolEnvironment(environment_factory=Steps).bind(tokenizer)
    with pytest.raises(RctpDataError, match="no training task has a reference"):
        build_rctp(None, load_tasks(rows(reference=False), env, "train_dataset"), tokenizer, CONFIG, settings(), 0)


def test_rollouts_labelled_by_the_reward_kept_one_to_one(tokenizer):
    env = ToolEnvironment(environment_factory=Steps).bind(tokenizer)
    tasks = load_tasks(rows(reference=False), env, "train_dataset")
    # Per task, 4 rollouts: one reaches the target, three do not.
    engine = Scripted(tokenizer, [reach, [call(1), "ok"], ["no"], [call(9), "ok"]])
    records = build_rctp(engine, tasks, tokenizer, CONFIG, settings(expert_source="rollouts"), 0, threshold=1.0)
    experts = [r for r in records if r.kind == "expert"]
    failures = [r for r in records if r.kind == "failure"]
    assert [r.entry_id for r in experts] == ["t4", "t6"] and all(r.reward == 1.0 for r in experts)
    assert len(failures) == 2 and {r.entry_id for r in failures} == {"t4", "t6"}  # spread over tasks
    assert all(r.reward_token == LOW_REWARD for r in failures)


def test_a_stronger_models_successes_are_replayed_under_the_policys_template(tokenizer):
    from pathlib import Path

    trl = require("trl", "trl")
    stronger = copy.deepcopy(tokenizer)  # another template: Qwen2.5's (TRL's copy), tools rendered by it
    stronger.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    env = ToolEnvironment(environment_factory=Steps).bind(tokenizer)
    tasks = load_tasks(rows(reference=False), env, "train_dataset")
    policy_engine = Scripted(tokenizer, [["no"]])  # the starting model never succeeds
    expert_engine = Scripted(stronger, [reach])
    records = build_rctp(policy_engine, tasks, tokenizer, CONFIG, settings(expert_source="rollouts", failure_attempts=1),
                         0, threshold=1.0, experts_from=(expert_engine, stronger))
    experts = [r for r in records if r.kind == "expert"]
    assert len(experts) == 2 and all(r.reward == 1.0 for r in experts)
    text = tokenizer.decode(experts[0].token_ids)
    assert "Tools (JSON schemas)" in text and "<tools>" not in text  # the policy's fallback prompt, not Qwen's
