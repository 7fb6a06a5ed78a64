"""Expert (and perturbed-expert) trajectories, played through the same agent
loop as model rollouts so their token layout is exactly what the policy sees.

A `ScriptedEngine` answers with fixed reply texts instead of sampling; the
environment executes them, and the reward function labels the result.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from rcgrpo.envs.calls import Call
from rcgrpo.envs.reward import ground_truth
from rcgrpo.envs.tool_env import different_value
from rcgrpo.rollout.agent_loop import Rollout, RolloutConfig, run_episodes
from rcgrpo.rollout.engine import Generation, SamplingConfig

# What the expert says when a turn's work is done (the reply with no call
# that ends a turn in BFCL's loop), and when a turn expects no call at all
# (miss_param: a required value is missing; miss_func: no fitting function).
TURN_DONE = "The requested operations are complete."
CANNOT_CALL = ("I cannot complete this request with the available functions and information: "
               "a required function or parameter is missing. Please provide it.")


def expert_turns(entry) -> list[list[str]]:
    """Per turn, the calls of the ground truth in canonical keyword form."""
    return ground_truth(entry).canonical_turns()


def expert_script(entry) -> list[str] | None:
    """The replies that play `entry`'s reference: BFCL's ground truth, or the
    `completion` column of a task under the TRL contract (None: it has none)."""
    environment = getattr(entry, "environment", None)
    if environment is not None:
        return environment.expert_replies(entry)
    return script_from_turns(expert_turns(entry))


def near_miss_scripts(entry, seed: int) -> Iterator[list[str]]:
    """The replies of every one-mistake version of `entry`'s reference, in a seeded order."""
    environment = getattr(entry, "environment", None)
    if environment is not None:
        yield from environment.near_miss_replies(entry, seed)
        return
    for turns in near_misses(entry, seed):
        yield script_from_turns(turns)


def script_from_turns(turns: Sequence[Sequence[str]]) -> list[str]:
    """The replies that play `turns`: one call list per turn that has calls,
    then a closing reply; a turn with no call gets the no-call reply."""
    replies = []
    for calls in turns:
        if calls:
            replies.append("[" + ", ".join(calls) + "]")
            replies.append(TURN_DONE)
        else:
            replies.append(CANNOT_CALL)
    return replies


@dataclass
class ScriptedEngine:
    """The engine protocol, answering one conversation with scripted texts."""

    tokenizer: object
    replies: list[str]
    name: str = "scripted"
    supports_sleep: bool = False

    def __post_init__(self):
        self._next = 0
        self._eot = self.tokenizer.eos_token_id

    def generate(self, prompts: Sequence[Sequence[int]], sampling) -> list[list[Generation]]:
        if len(prompts) != 1:
            raise ValueError("a ScriptedEngine plays one conversation at a time")
        text = self.replies[self._next] if self._next < len(self.replies) else TURN_DONE
        self._next += 1
        # Plain text, as a model that wrote these characters would have
        # sampled them; the end of the message is the one control token.
        ids = list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]) + [self._eot]
        budget = (sampling if isinstance(sampling, SamplingConfig) else sampling[0]).max_tokens
        finish = "stop"
        if len(ids) > budget:  # the same cut a sampling engine would make
            ids, finish = ids[:budget], "length"
        return [[Generation(ids, None, finish)]]

    def load_weights(self, named_tensors: Iterable) -> None:  # nothing to load
        pass

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass


def play_script(entry, tokenizer, replies: list[str], config: RolloutConfig,
                reward_token: str | None = None) -> Rollout:
    """One trajectory of `entry` driven by `replies`, scored by the environment."""
    engine = ScriptedEngine(tokenizer, replies)
    (rollout,) = run_episodes(engine, tokenizer, [entry], group_size=1, config=config,
                              reward_tokens=[reward_token])
    return rollout


PERTURBATIONS = ("dropped", "wrong_value")


def _perturbed(calls: list[list[Call]], t: int, i: int, kind: str) -> list[list[str]]:
    """`calls` (per turn) with call i of turn t dropped or given a wrong value."""
    out = [list(turn) for turn in calls]
    if kind == "dropped":
        del out[t][i]
    elif kind == "wrong_value":
        call = out[t][i]
        key = sorted(call.kwargs)[0]
        out[t][i] = Call(call.name, {**call.kwargs, key: different_value(call.kwargs[key])})
    else:
        raise ValueError(f"unknown perturbation {kind!r}")
    return [[c.canonical() for c in turn] for turn in out]


def _spots(calls: list[list[Call]], kind: str) -> list[tuple[int, int]]:
    spots = [(t, i) for t, turn in enumerate(calls) for i in range(len(turn))]
    return [(t, i) for t, i in spots if calls[t][i].kwargs] if kind == "wrong_value" else spots


def perturbed_turns(entry, kind: str, seed: int) -> list[list[str]] | None:
    """Ground truth with one mistake: a dropped call, or one argument value
    changed. None when the entry has no call to perturb."""
    calls = [list(turn) for turn in ground_truth(entry).calls]
    spots = _spots(calls, kind)
    if kind not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {kind!r}")
    if not spots:
        return None
    t, i = random.Random(f"{seed}:{entry.id}:{kind}").choice(spots)
    return _perturbed(calls, t, i, kind)


def near_misses(entry, seed: int) -> Iterator[list[list[str]]]:
    """Every one-mistake version of the ground truth (each call dropped, each
    call's first argument changed), in a seeded order that alternates the two
    kinds: the candidates a near-miss failure is drawn from."""
    calls = [list(turn) for turn in ground_truth(entry).calls]
    orders = []
    for kind in PERTURBATIONS:
        spots = _spots(calls, kind)
        random.Random(f"{seed}:{entry.id}:{kind}").shuffle(spots)
        orders.append([(kind, t, i) for t, i in spots])
    for k in range(max(map(len, orders), default=0)):
        for order in orders:
            if k < len(order):
                kind, t, i = order[k]
                yield _perturbed(calls, t, i, kind)
