"""Environments in TRL's contract played as episodes (rcgrpo/envs/tool_env.py):
token in, token out; tool results fed back as tool messages and masked out of
the loss; calls that cannot run are scored failures fed back, never run; and
every way a user environment can misbehave (a tool that raises, hangs, floods,
returns bytes or changes module state; a reset or reward function that
raises; a reward that is NaN, None or out of range) is a scored failure with
one warning line, never a crash or a hang."""
import logging
import time

import pytest

from rcgrpo.data.expert import ScriptedEngine, play_script
from rcgrpo.envs.budget import EpisodeBudget
from rcgrpo.envs.tasks import load_tasks
from rcgrpo.envs.tool_env import EnvironmentContractError, ToolEnvironment
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes

CONFIG = RolloutConfig(progress=False, max_new_tokens=512, max_total_tokens=4096)
ROW = {"prompt": "Reach the target.", "target": 5, "id": "t5"}

SHARED_LIST: list = []
COUNTER = 0


def call(name, **arguments):
    return '<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (name, __import__("json").dumps(arguments))


class Counter:
    """A small environment in TRL's contract: state per instance, reward from it."""

    calls_run: list = []  # what the tools really ran (on the class: module globals are watched)

    def reset(self, target=0, **row):
        self.total, self.target = 0, target
        return f"\nTarget: {target}"

    def add(self, amount: int) -> str:
        """Add to the running total.

        Args:
            amount: how much to add
        """
        Counter.calls_run.append(("add", amount))
        self.total += amount
        return f"total={self.total}"

    def get_reward(self) -> float:
        return float(self.total == self.target)


class Misbehaving(Counter):
    def boom(self) -> str:
        """Raise."""
        raise RuntimeError("tool exploded")

    def hang(self) -> str:
        """Loop forever."""
        while True:
            pass

    def doze(self) -> str:
        """Sleep in one native call, past every bound."""
        time.sleep(20)
        return "late"

    async def fetch(self, key: str) -> str:
        """An async tool (TRL accepts them).

        Args:
            key: what to fetch
        """
        return f"value of {key}"

    def flood(self) -> str:
        """Return megabytes."""
        return "x" * 5_000_000

    def raw(self) -> bytes:
        """Return bytes."""
        return b"\x00\x01"

    def grow_shared(self) -> str:
        """Append to a module-level list."""
        SHARED_LIST.append(1)
        return "ok"

    def rebind_global(self) -> str:
        """Rebind a module global."""
        global COUNTER
        COUNTER += 1
        return "ok"


def environment(tokenizer, factory=Counter, **options) -> ToolEnvironment:
    return ToolEnvironment(environment_factory=factory, call_timeout_s=options.pop("call_timeout_s", 2.0),
                           **options).bind(tokenizer)


def play(env, replies, row=ROW, token=None):
    (task,) = load_tasks([row], env, "train_dataset")
    return play_script(task, env.format.tokenizer, replies, CONFIG, reward_token=token)


def test_token_in_token_out_with_tool_results_masked(tokenizer):
    env = environment(tokenizer)
    replies = [call("add", amount=2), call("add", amount=3), "Done."]
    r = play(env, replies, token="<|high_reward|>")
    assert (r.reward, r.valid, r.end_reason, r.steps) == (1.0, True, "completed", 3)
    sampled = [t for t, m in zip(r.token_ids, r.sampled_mask) if m]
    # Exactly the engine's ids, never re-tokenised: each reply's ids and its end-of-message token.
    expected = sum((tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in replies), [])
    assert sampled == expected
    unmasked = tokenizer.decode([t for t, m in zip(r.token_ids, r.sampled_mask) if not m])
    assert "total=2" in unmasked and "total=5" in unmasked  # tool results: prompt side, masked out of the loss
    assert "total=" not in tokenizer.decode(sampled)
    assert "Target: 5" in unmasked and "<|high_reward|>" in unmasked  # reset's text and the tag on the user message


def test_calls_that_cannot_run_are_fed_back_and_never_run(tokenizer):
    env = environment(tokenizer)
    Counter.calls_run.clear()
    replies = [call("add", amount="two"), call("add", amount=1, extra=2), call("subtract", amount=1),
               "<tool_call>{broken</tool_call>", call("add"), "stop"]
    r = play(env, replies)
    tool_texts = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert Counter.calls_run == []  # none of them ran
    assert len(tool_texts) == 5 and all(t.startswith("Error:") for t in tool_texts)
    assert "must be integer" in tool_texts[0] and "unknown argument" in tool_texts[1]
    assert "unknown tool 'subtract'" in tool_texts[2] and "not valid JSON" in tool_texts[3]
    assert "missing required argument 'amount'" in tool_texts[4]
    assert (r.reward, r.valid, r.end_reason) == (0.0, False, "completed")  # scored by the environment, no crash


def test_the_step_limit_ends_the_episode(tokenizer):
    env = environment(tokenizer, max_tool_steps=2)
    r = play(env, [call("add", amount=1)] * 5)
    assert r.end_reason == "step_limit" and r.steps == 3


@pytest.mark.parametrize("tool,expect", [
    ("boom", "raised RuntimeError: tool exploded"),
    ("hang", "did not return within 0.5 s"),
    ("raw", "returned 2 bytes, not text"),
])
def test_a_tool_that_fails_is_an_error_result(tokenizer, tool, expect):
    env = environment(tokenizer, factory=Misbehaving, call_timeout_s=0.5)
    started = time.monotonic()
    r = play(env, [call(tool), call("add", amount=5), "done"])
    assert time.monotonic() - started < 10  # no hang
    texts = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert expect in texts[0]
    assert texts[1] == "total=5" and r.reward == 1.0  # the episode goes on after it


@pytest.mark.slow  # waits out the call's bound and the stop's grace (~5 s)
def test_a_tool_stuck_in_native_code_is_abandoned_and_ends_its_rollout(tokenizer, caplog):
    env = environment(tokenizer, factory=Misbehaving, call_timeout_s=0.5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rcgrpo.envs"):
        r = play(env, [call("doze"), call("add", amount=5), "done"])
    assert time.monotonic() - started < 15  # the bound plus the stop's grace, not the 20 s sleep
    assert (r.reward, r.end_reason) == (0.0, "call_did_not_stop") and "abandoned still running" in caplog.text


def test_an_async_tool_runs(tokenizer):
    r = play(environment(tokenizer, factory=Misbehaving), [call("fetch", key="k"), "done"])
    assert [m["content"] for m in r.messages if m["role"] == "tool"] == ["value of k"]


def test_a_flooding_tool_is_clipped(tokenizer):
    env = environment(tokenizer, factory=Misbehaving, budget=lambda: EpisodeBudget(tool_text_chars=2_000))
    r = play(env, [call("flood"), "done"])
    (text,) = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert len(text) < 2_200 and "4998000 more characters cut" in text
    # With the default bound (100,000 characters), the clipped result still outgrows the context: the episode
    # ends there instead of feeding it.
    r = play(environment(tokenizer, factory=Misbehaving), [call("flood"), "done"])
    assert r.end_reason == "max_length" and len(r.token_ids) < CONFIG.max_total_tokens


@pytest.mark.parametrize("tool,what", [("grow_shared", "SHARED_LIST (changed in place)"),
                                       ("rebind_global", "COUNTER (rebound)")])
def test_a_tool_that_changes_module_state_fails_its_rollout(tokenizer, tool, what, caplog):
    env = environment(tokenizer, factory=Misbehaving)
    before = COUNTER
    with caplog.at_level(logging.WARNING, logger="rcgrpo.envs"):
        r = play(env, [call("add", amount=5), call(tool), "done"])
    assert COUNTER == before  # a rebinding is put back
    assert (r.reward, r.valid, r.end_reason) == (0.0, False, "module_state_changed")
    (line,) = caplog.messages
    assert what in line and "Misbehaving" in line and "\n" not in line


class ResetRaises(Counter):
    def reset(self, **row):
        raise ValueError("no such task")


class RewardNaN(Counter):
    def get_reward(self) -> float:
        return float("nan")


def _reward_raises(prompts, completions, **kwargs):
    raise KeyError("missing column")


def _reward_none(prompts, completions, **kwargs):
    return [None] * len(prompts)


def _reward_big(prompts, completions, **kwargs):
    return [7.0] * len(prompts)


def _reward_wrong_length(prompts, completions, **kwargs):
    return [1.0, 1.0]


@pytest.mark.parametrize("options,expect", [
    (dict(factory=ResetRaises), "reset() raised ValueError: no such task"),
    (dict(factory=RewardNaN), "get_reward() returned nan"),
    (dict(reward_funcs=[_reward_raises]), "reward function _reward_raises raised KeyError"),
    (dict(factory=type("NoReward", (), {"reset": lambda self, **r: None}), reward_funcs=[_reward_none]),
     "every reward source returned None"),
    (dict(reward_funcs=[_reward_big], reward_range=(0.0, 1.0)), "returned 7, outside reward_range [0.0, 1.0]"),
    (dict(reward_funcs=[_reward_wrong_length]), "not a list with one reward per completion"),
])
def test_a_broken_reset_or_reward_is_a_scored_failure(tokenizer, options, expect, caplog):
    env = environment(tokenizer, **options)
    with caplog.at_level(logging.WARNING, logger="rcgrpo.envs"):
        rewards = [play(env, [call("add", amount=5), "done"]).reward for _ in range(3)]
    assert rewards == [0.0, 0.0, 0.0]
    assert len(caplog.messages) == 1, caplog.messages  # one line, however many rollouts it hits
    assert expect in caplog.messages[0] and "\n" not in caplog.messages[0]


def test_reward_functions_get_trl_arguments_and_are_summed(tokenizer):
    seen = {}

    def graded(prompts, completions, completion_ids, target, environments, **kwargs):
        seen.update(prompts=prompts, completions=completions, target=target, ids=completion_ids, env=environments)
        return [0.25]

    env = environment(tokenizer, reward_funcs=[graded], reward_weights=[2.0])
    r = play(env, [call("add", amount=5), "done"])
    assert r.reward == pytest.approx(1.5)  # get_reward 1 + 2 x 0.25
    assert seen["target"] == [5] and seen["prompts"][0][-1]["content"].endswith("Target: 5")
    completion = seen["completions"][0]
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
    assert completion[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"amount": 5}}
    assert tokenizer.decode(seen["ids"][0]).startswith("<tool_call>")
    assert seen["env"][0].total == 5


def test_the_run_goes_on_past_a_failing_rollout(tokenizer):
    # Several rollouts in one engine call: one resets badly, the others play.
    class Picky(Counter):
        def reset(self, target=0, **row):
            if target < 0:
                raise ValueError("negative target")
            return super().reset(target=target)

    env = environment(tokenizer, factory=Picky)
    tasks = load_tasks([{"prompt": "go", "target": t} for t in (5, -1, 5)], env, "train_dataset")
    engine = _PerConversation(tokenizer, [call("add", amount=5), "done"])
    rollouts = run_episodes(engine, tokenizer, tasks, group_size=1, config=CONFIG, reward_tokens=None)
    assert [r.reward for r in rollouts] == [1.0, 0.0, 1.0]
    assert rollouts[1].end_reason == "reset_failed"


class _PerConversation:
    """A scripted engine answering every conversation of a batch with the same replies."""

    name, supports_sleep = "scripted", False

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies = tokenizer, replies

    def generate(self, prompts, sampling):
        # A conversation's next reply: the number of assistant replies it holds already.
        return [ScriptedEngine(self.tokenizer, self.replies[self.tokenizer.decode(p).count("assistant\n") - 1:])
                .generate([p], [s])[0] for p, s in zip(prompts, sampling)]


def test_an_unusable_environment_is_one_line_before_anything_runs():
    class NoReset:
        def add(self, amount: int) -> str:
            """Add.

            Args:
                amount: how much
            """
            return ""

    def factory_raises():
        raise OSError("cannot connect")

    def untyped(x):
        return x

    for options, expect in [(dict(environment_factory=NoReset), "need a callable reset"),
                            (dict(environment_factory=factory_raises), "raised OSError: cannot connect"),
                            (dict(environment_factory=type("Bare", (), {"reset": lambda self, **r: None})),
                             "no reward source"),
                            (dict(tools=[untyped], reward_funcs=[_reward_none]), "no JSON schema")]:
        with pytest.raises(EnvironmentContractError, match=expect) as info:
            ToolEnvironment(**options)
        assert "\n" not in str(info.value)
