"""Many multi-turn episodes at once (BFCL's, or any environment's under the
TRL contract: rcgrpo.envs.episode), token-in / token-out.

Each conversation is a growing list of token ids. The engine's sampled ids are
appended as they are (sampled mask 1); tool results and the next turn's user
messages are appended as the ids of the chat template's rendering of just
those messages (mask 0). Decoded text only goes to the environment and into a
readable message log; it is never tokenised again. All live conversations
advance together: one engine call per step serves all of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
from rcgrpo.conditioning.reward_tokens import Conditioning, DrawPerRollout, rollout_tokens
from rcgrpo.envs.episode import new_episode
from rcgrpo.rollout.engine import Engine, SamplingConfig, check_generations
from rcgrpo.run.metrics import progress


@dataclass
class RolloutConfig:
    max_new_tokens: int = 256  # per model reply
    max_total_tokens: int = 8192  # whole conversation; SmolLM2's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    doc_style: str = "compact"
    progress: bool = True
    policy_version: int = 0  # the version of the weights the engine holds (recorded per sampled token)


@dataclass
class Rollout:
    entry_id: str
    group: int  # index of the entry in the call: rollouts of one prompt share it
    reward_token: str | None
    token_ids: list[int]
    sampled_mask: list[int]  # 1 exactly on the tokens the engine sampled
    # The engine's log-prob of each sampled token (0.0 elsewhere); None when
    # the engine did not report them for every reply.
    logprobs: list[float] | None
    prompt_len: int
    reward: float = 0.0
    r_state: float = 0.0
    r_action: float = 0.0
    valid: bool = False  # official BFCL verdict
    turns: int = 0
    steps: int = 0
    end_reason: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)  # readable log
    versions: list[int] = field(default_factory=list)  # policy version per sampled token, -1 elsewhere


class _Conversation:
    """One rollout in progress: its episode, ids, mask and message log."""

    def __init__(self, index: int, rollout: Rollout, episode, chat: ChatTokens, cfg: RolloutConfig):
        self.index, self.r, self.ep, self.chat, self.cfg = index, rollout, episode, chat, cfg
        self.r.versions = [-1] * len(self.r.token_ids)
        self.logprobs_missing = False

    @property
    def done(self) -> bool:
        return self.ep.done

    def budget(self) -> int:
        return min(self.cfg.max_new_tokens, self.cfg.max_total_tokens - len(self.r.token_ids))

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, sampled: bool) -> None:
        self.r.token_ids.extend(ids)
        self.r.sampled_mask.extend([int(sampled)] * len(ids))
        self.r.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.r.versions.extend([self.cfg.policy_version if sampled else -1] * len(ids))

    def consume(self, ids: list[int], logprobs: list[float] | None, finish_reason: str) -> None:
        """Append a model reply, let the environment act on it, append what follows."""
        if logprobs is None or len(logprobs) != len(ids):
            # A zero would read as probability 1: the rollout reports none instead.
            self.logprobs_missing = True
            logprobs = None
        self.append(ids, logprobs, sampled=True)
        closed = bool(ids) and ids[-1] == self.chat.eot_id
        text = self.chat.decode_reply(ids)
        self.r.messages.append({"role": "assistant", "content": text})
        if finish_reason == "length" and len(self.r.token_ids) >= self.cfg.max_total_tokens:
            # Cut by the context limit, not by the model: not a reply to execute.
            self.ep.finish("max_length")
            return
        step_reply = getattr(self.ep, "step_reply", None)  # a parser that may read the ids (rcgrpo.envs.tool_env)
        res = step_reply(ids, text, self.r.token_ids) if step_reply is not None else self.ep.step(text)
        if self.ep.done:
            return
        new = res.tool_messages if not res.turn_ended else self.ep.turn_messages()
        suffix = self.chat.continuation_ids(self.r.messages, new, reply_closed=closed)
        if len(self.r.token_ids) + len(suffix) >= self.cfg.max_total_tokens:
            # No room left for the model to answer what it would be shown.
            self.ep.finish("max_length")
            return
        self.append(suffix, None, sampled=False)
        self.r.messages.extend(new)

    def close(self) -> Rollout:
        res = self.ep.result()
        self.r.reward, self.r.r_state, self.r.r_action = res.reward, res.r_state, res.r_action
        self.r.valid, self.r.turns, self.r.steps, self.r.end_reason = res.valid, res.turns, res.steps, res.end_reason
        if self.logprobs_missing:
            self.r.logprobs = None
        return self.r


def run_episodes(
    engine: Engine,
    tokenizer,
    entries: Sequence,
    group_size: int = 5,
    config: RolloutConfig | None = None,
    reward_tokens: Conditioning = DrawPerRollout(),
    episode_factory: Callable | None = None,
) -> list[Rollout]:
    """Play `group_size` rollouts of every entry; rollouts come back entry by entry.

    reward_tokens (rcgrpo.conditioning.reward_tokens.Conditioning): DrawPerRollout(p_high)
    draws one per rollout, seeded by `config.seed`; a token, or None, conditions
    every rollout on it; a list gives one token (or None) per rollout.
    """
    cfg = config or RolloutConfig()
    rng = random.Random(cfg.seed)
    tokens = rollout_tokens(reward_tokens, len(entries) * group_size, rng)
    convs = _start_conversations(entries, group_size, tokens, episode_factory or new_episode, tokenizer, cfg)
    _play(engine, convs, cfg)
    return [c.close() for c in convs]


def _start_conversations(entries: Sequence, group_size: int, tokens: Sequence[str | None],
                         episode_factory: Callable, tokenizer, cfg: RolloutConfig) -> list[_Conversation]:
    """One conversation per rollout, entry by entry, each at its prompt
    (conditioned on `tokens[j]`, rollout j's reward token). The group is the
    entry's position in the call: the task's identity, never its prompt's
    tokens (which differ between rollouts of different tags)."""
    convs: list[_Conversation] = []
    for g, entry in enumerate(entries):
        for k in range(group_size):
            j = g * group_size + k
            ep = episode_factory(entry)
            chat = ChatTokens(tokenizer, tools=getattr(ep, "template_tools", None))
            messages = initial_messages(ep, tokens[j], cfg.doc_style)
            ids = chat.prompt_ids(messages)
            r = Rollout(entry.id, g, tokens[j], ids, [0] * len(ids), [0.0] * len(ids), len(ids), messages=messages)
            conv = _Conversation(j, r, ep, chat, cfg)
            if len(ids) >= cfg.max_total_tokens:
                ep.finish("prompt_too_long")
            convs.append(conv)
    return convs


def _play(engine: Engine, convs: list[_Conversation], cfg: RolloutConfig) -> None:
    """Advance every live conversation by one reply per step, one engine call
    per step, until all are done."""
    bar = progress(total=len(convs), desc="rollouts", unit="ep", disable=not cfg.progress, leave=False)
    bar.update(sum(c.done for c in convs))
    step = 0
    while active := _ready_to_reply(convs):
        outputs = engine.generate([c.r.token_ids for c in active], _sampling(active, cfg, step))
        check_generations(engine, outputs)
        for c, gens in zip(active, outputs):
            g = gens[0]
            c.consume(list(g.token_ids), g.logprobs, g.finish_reason)
        step += 1
        finished = sum(c.done for c in active)
        bar.update(finished)
        bar.set_postfix(step=step, active=len(active) - finished)
    bar.close()


def _ready_to_reply(convs: list[_Conversation]) -> list[_Conversation]:
    """The conversations not done; those without room for a reply are finished first."""
    active = [c for c in convs if not c.done]
    for c in active:
        if c.budget() <= 0:
            c.ep.finish("max_length")
    return [c for c in active if not c.done]


def _sampling(active: list[_Conversation], cfg: RolloutConfig, step: int) -> list[SamplingConfig]:
    return [
        SamplingConfig(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_tokens=c.budget(),
            # Distinct, reproducible per rollout and step, whatever the batch.
            seed=(cfg.seed * 1_000_003 + c.index * 10_007 + step) % (2**31),
        )
        for c in active
    ]
