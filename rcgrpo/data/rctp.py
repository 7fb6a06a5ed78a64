"""The RCTP data set: expert and failure trajectories, each labelled by the
reward function and tagged with the matching reward token (the paper, arXiv
2602.03025; the label rule: rcgrpo.conditioning.reward_tokens.label_for_reward).

* expert: the ground truth of a training entry, played through the agent loop;
* failure (kind "failure"): reward-0 rollouts of the starting model, all of
  them (`rctp.failure_source rollouts`, the paper's source) or only those
  whose first divergence from the expert comes late (`late_divergence`);
* near miss (kind "perturbed"): the expert trajectory with one call dropped
  or one argument changed, executed (`near_miss`; also what tops up a
  rollout source short of failures).

Labels are never assumed: every failure is a trajectory the environment gave
reward 0, and a perturbed trajectory that still earns reward 1 is not kept.
Each trajectory's prompt is rendered with the tag of its label
(`\\n\\n[Reward Goal: <|..._reward|>]` after the first user message); the
rest of its ids are exactly those the agent loop produced. Records go to a
JSONL file so the fine-tuning stage can re-run without regenerating.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

from rcgrpo.base import json_input
from rcgrpo.base.atomic import atomic_output
from rcgrpo.base.errors import UserError
from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, label_for_reward
from rcgrpo.data.divergence import divergences, first_divergence
from rcgrpo.data.expert import expert_script, near_miss_scripts, play_script
from rcgrpo.envs.episode import new_episode
from rcgrpo.model.packing import Trajectory
from rcgrpo.rollout.agent_loop import Rollout, RolloutConfig, run_episodes
from rcgrpo.run.metrics import log_line, progress


@dataclass
class Record:
    entry_id: str
    kind: str  # expert | failure | perturbed
    reward: float
    r_state: float
    r_action: float
    valid: bool
    reward_token: str | None  # the tag its prompt carries (None: untagged SFT data)
    token_ids: list[int]
    sampled_mask: list[int]  # 1 on the tokens the policy generated (the ones trained on)
    end_reason: str

    def trajectory(self) -> Trajectory:
        return Trajectory(self.token_ids, self.sampled_mask, reward=self.reward,
                          meta={"entry_id": self.entry_id, "kind": self.kind})


def retag(rollout: Rollout, entry, tokenizer, token: str | None, doc_style: str, kind: str) -> Record:
    """The rollout with its prompt re-rendered under `token`: only the opening
    prompt changes; every later id (replies, tool results, next turns) was
    appended independently of it and is kept as produced."""
    episode = new_episode(entry)
    prompt = ChatTokens(tokenizer, getattr(episode, "template_tools", None)).prompt_ids(
        initial_messages(episode, token, doc_style))
    rest = slice(rollout.prompt_len, None)
    return Record(
        entry_id=rollout.entry_id, kind=kind, reward=rollout.reward, r_state=rollout.r_state,
        r_action=rollout.r_action, valid=rollout.valid, reward_token=token,
        token_ids=prompt + rollout.token_ids[rest], sampled_mask=[0] * len(prompt) + rollout.sampled_mask[rest],
        end_reason=rollout.end_reason,
    )


def _labelled(rollout, entry, tokenizer, kind, doc_style, tagged: bool, threshold: float = 1.0) -> Record:
    label = label_for_reward(rollout.reward, threshold) if tagged else None
    return retag(rollout, entry, tokenizer, label, doc_style, kind)


def demonstration_config(config: RolloutConfig) -> RolloutConfig:
    """A scripted reply is never cut by the sampling budget of one reply (a
    long call list is still one correct reply); only the context limit applies."""
    return replace(config, max_new_tokens=config.max_total_tokens)


def expert_records(entries: Sequence, tokenizer, config: RolloutConfig, tagged: bool,
                   threshold: float = 1.0) -> list[Record]:
    """Each entry's reference played and labelled (entries without one are left out)."""
    config = demonstration_config(config)
    out = []
    for entry in progress(entries, desc="expert trajectories", leave=False):
        script = expert_script(entry)
        if script is None:
            continue
        rollout = play_script(entry, tokenizer, script, config)
        out.append(_labelled(rollout, entry, tokenizer, "expert", config.doc_style, tagged, threshold))
    return out


def _spread(records: list[Record]) -> list[Record]:
    """At most one record per entry first, so that a cut keeps many entries."""
    first, rest, seen = [], [], set()
    for r in records:
        (rest if r.entry_id in seen else first).append(r)
        seen.add(r.entry_id)
    return first + rest


def failure_records(engine, entries: Sequence, tokenizer, config: RolloutConfig, attempts: int, needed: int,
                    experts: Sequence[Record] = (), min_divergence: int | None = None,
                    threshold: float = 1.0) -> list[Record]:
    """Failed rollouts (reward below `threshold`) of the starting model
    (unconditioned), at most one per entry first, so failures spread over
    entries. With `min_divergence`, only rollouts whose first divergence from
    their entry's expert record comes at least that many generated tokens
    into the reply."""
    if needed <= 0 or attempts <= 0:
        return []
    rollouts = run_episodes(engine, tokenizer, list(entries), group_size=attempts, config=config, reward_tokens=None)
    by_id = {e.id: e for e in entries}
    expert_of = {r.entry_id: r for r in experts}
    candidates = []
    for r in rollouts:
        if r.reward >= threshold:
            continue
        record = _labelled(r, by_id[r.entry_id], tokenizer, "failure", config.doc_style, True, threshold)
        if min_divergence is not None:
            d = first_divergence(expert_of[r.entry_id], record) if r.entry_id in expert_of else None
            if d is None or d.reply_offset < min_divergence:
                continue
        candidates.append(record)
    return _spread(candidates)[:needed]


def replayed_experts(engine, engine_tokenizer, entries: Sequence, tokenizer, config: RolloutConfig, attempts: int,
                     threshold: float) -> list[Record]:
    """A stronger model's successful rollouts as experts of the policy: played
    under its own tokenizer and template, their reply texts replayed through
    the policy's (demonstrations, like references: the policy never sampled
    them), kept when the replay succeeds too."""
    by_id = {e.id: e for e in entries}
    out = []
    for r in run_episodes(engine, engine_tokenizer, list(entries), group_size=attempts, config=config,
                          reward_tokens=None):
        if r.reward < threshold:
            continue
        replies = [m["content"] for m in r.messages if m["role"] == "assistant"]  # its replies, in order
        replay = play_script(by_id[r.entry_id], tokenizer, replies, demonstration_config(config))
        if replay.reward >= threshold:
            out.append(_labelled(replay, by_id[r.entry_id], tokenizer, "expert", config.doc_style, True, threshold))
    return out


def rollout_records(engine, entries: Sequence, tokenizer, config: RolloutConfig, attempts: int,
                    threshold: float, experts_from=None) -> tuple[list[Record], list[Record]]:
    """The paper's way: the starting model's rollouts, labelled by the reward
    (success iff reward >= `threshold`), as (experts, failures), 1:1: as many
    of each as the scarcer kind has, spread over entries. `experts_from`: a
    stronger model's (engine, tokenizer), whose successes are the experts
    instead (`replayed_experts`)."""
    rollouts = run_episodes(engine, tokenizer, list(entries), group_size=attempts, config=config, reward_tokens=None)
    by_id = {e.id: e for e in entries}
    experts, failures = [], []
    for r in rollouts:
        kind = "expert" if r.reward >= threshold else "failure"
        record = _labelled(r, by_id[r.entry_id], tokenizer, kind, config.doc_style, True, threshold)
        (experts if kind == "expert" else failures).append(record)
    if experts_from is not None:
        experts = replayed_experts(*experts_from, entries, tokenizer, config, attempts, threshold)
    n = min(len(experts), len(failures))
    source = "the expert model's successes" if experts_from is not None else "succeed"
    log_line(f"[rctp-data] {len(rollouts)} rollouts of the starting model: {len(experts)} {source}, "
             f"{len(failures)} fail; {n} of each kept (1:1)")
    return _spread(experts)[:n], _spread(failures)[:n]


def near_miss_records(entries: Sequence, tokenizer, config: RolloutConfig, needed: int, seed: int,
                      threshold: float = 1.0) -> list[Record]:
    """Expert trajectories with one mistake (a call dropped, or an argument
    changed; `expert.near_misses`), executed and labelled by the reward: a
    version that still earns reward 1 is not a failure and is not kept. One
    per entry per round, in `entries`' order, until `needed` are found or
    every entry's versions are used up."""
    config = demonstration_config(config)
    candidates = {e.id: near_miss_scripts(e, seed) for e in entries}
    out: list[Record] = []
    while len(out) < needed and candidates:
        for entry in entries:
            if len(out) >= needed:
                break
            for replies in candidates.get(entry.id, ()):
                rollout = play_script(entry, tokenizer, replies, config)
                if rollout.reward < threshold:
                    out.append(_labelled(rollout, entry, tokenizer, "perturbed", config.doc_style, True, threshold))
                    break
            else:
                candidates.pop(entry.id, None)  # no failing version left
    return out


def build_rctp(engine, entries: Sequence, tokenizer, config: RolloutConfig, rctp, seed: int,
               threshold: float = 1.0, experts_from=None) -> list[Record]:
    """Expert + failure records, `rctp.failure_ratio` failures per expert (the
    paper: 1:1), labelled high iff reward >= `threshold` (env.success_threshold).
    Experts from `rctp.expert_source`: the references (ground truth, a data
    set's completions), or the starting model's successful rollouts, whose
    failed rollouts are then the failures. Otherwise the failures come from
    `rctp.failure_source` (rcgrpo.config.schema, FAILURE_SOURCES). `rctp` is
    the config's RctpConfig. With `rctp.fill_with_perturbed`, rollout sources
    short of failures are topped up with near misses, entries without a
    failure first. `experts_from`: (engine, tokenizer) of `rctp.expert_model`."""
    if rctp.expert_source == "rollouts":
        experts, failures = rollout_records(engine, entries, tokenizer, config, max(rctp.failure_attempts, 1),
                                            threshold, experts_from)
        if not experts:
            raise RctpDataError("rctp.expert_source rollouts: no rollout of the starting model succeeded, so RCTP "
                                "has no expert; raise rctp.failure_attempts or use references")
        return experts + failures
    experts = expert_records(entries, tokenizer, config, tagged=True, threshold=threshold)
    if not experts:
        raise RctpDataError("RCTP has no expert: no training task has a reference (a completion column); use "
                            "--rctp.expert_source rollouts")
    needed = int(round(rctp.failure_ratio * len(experts)))
    source = rctp.failure_source
    if source == "near_miss":
        failures = near_miss_records(entries, tokenizer, config, needed, seed, threshold)
    else:
        failures = failure_records(engine, entries, tokenizer, config, rctp.failure_attempts, needed, experts,
                                   rctp.min_divergence_tokens if source == "late_divergence" else None, threshold)
    log_line(f"[rctp-data] {len(experts)} expert, {len(failures)} failures from {source} (needed {needed})")
    if len(failures) < needed and rctp.fill_with_perturbed and source != "near_miss":
        have = {r.entry_id for r in failures}
        order = sorted(entries, key=lambda e: e.id in have)
        filled = near_miss_records(order, tokenizer, config, needed - len(failures), seed, threshold)
        log_line(f"[rctp-data] filled with {len(filled)} near misses (perturbed expert trajectories)")
        failures += filled
    return experts + failures


def save_records(records: Sequence[Record], path: Path) -> Path:
    """JSONL, written to a temp file and renamed: a crash leaves no half file."""
    with atomic_output(path) as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    return path


class RctpDataError(UserError, ValueError):
    """An RCTP data file is missing, unreadable, malformed or empty (names the file and line)."""


KINDS = ("expert", "failure", "perturbed")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is no token id


def _field_problem(record: Record, vocab_size: int | None) -> str | None:
    """The first field of `record` (as read from JSON) of the wrong type or
    out of range, as "field: what is wrong"; None when every field is right.
    Token ids must be ids of the tokenizer (`vocab_size`, when given): one out
    of range would otherwise fail only inside the model's embedding."""
    if not isinstance(record.entry_id, str):
        return f"entry_id: expected a string, got {record.entry_id!r}"
    if record.kind not in KINDS:
        return f"kind: expected one of {KINDS}, got {record.kind!r}"
    for name in ("reward", "r_state", "r_action"):
        v = getattr(record, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"{name}: expected a finite number, got {v!r}"
    if not isinstance(record.valid, bool):
        return f"valid: expected true or false, got {record.valid!r}"
    if record.reward_token is not None and not isinstance(record.reward_token, str):
        return f"reward_token: expected a string or null, got {record.reward_token!r}"
    if not isinstance(record.end_reason, str):
        return f"end_reason: expected a string, got {record.end_reason!r}"
    for name in ("token_ids", "sampled_mask"):
        if not isinstance(getattr(record, name), list):
            return f"{name}: expected a list of integers, got {type(getattr(record, name)).__name__}"
    if not record.token_ids:
        return "token_ids: empty"
    for i, t in enumerate(record.token_ids):
        if not _is_int(t):
            return f"token_ids[{i}]: expected an integer token id, got {t!r}"
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            limit = f"the tokenizer's {vocab_size}" if vocab_size is not None else "a valid"
            return f"token_ids[{i}]: {t} is outside {limit} token ids (0 <= id < vocabulary size)"
    for i, m in enumerate(record.sampled_mask):
        if not _is_int(m) or m not in (0, 1):
            return f"sampled_mask[{i}]: expected 0 or 1, got {m!r}"
    if len(record.token_ids) != len(record.sampled_mask):
        return (f"sampled_mask: {len(record.sampled_mask)} entries for {len(record.token_ids)} token_ids "
                "(ids and mask differ in length)")
    return None


def load_records(path: Path, vocab_size: int | None = None) -> list[Record]:
    """The records of an RCTP JSONL file, every field checked (token ids
    against `vocab_size`, the tokenizer's, when given); RctpDataError names
    the file, the line (record) and the field of the first problem."""
    if not Path(path).exists():
        raise RctpDataError(f"RCTP data file is missing: {path}")
    try:
        lines = json_input.read_text(path).splitlines()
    except ValueError as exc:
        raise RctpDataError(f"RCTP data file {exc}") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json_input.loads(line)
            if isinstance(row, dict) and "loss_mask" in row and "sampled_mask" not in row:
                # Files written before the field was renamed keep loading (same meaning).
                row["sampled_mask"] = row.pop("loss_mask")
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            record = Record(**row)
        except (ValueError, TypeError) as exc:
            raise RctpDataError(f"RCTP data file is malformed: {path}:{lineno}: {exc}") from None
        problem = _field_problem(record, vocab_size)
        if problem:
            raise RctpDataError(f"RCTP data file is malformed: {path}:{lineno} (record {len(records) + 1}, "
                                f"entry {record.entry_id!r}): {problem}")
        records.append(record)
    if not records:
        raise RctpDataError(f"RCTP data file {path} holds no records")
    return records


def summary(records: Sequence[Record]) -> dict:
    """Counts per kind and tag, and where the failures part from their
    entry's expert (generated tokens into the reply: min, median, max)."""
    out: dict = {"total": len(records)}
    for r in records:
        key = f"{r.kind}_{'high' if r.reward_token == HIGH_REWARD else 'low'}"
        out[key] = out.get(key, 0) + 1
    offsets = sorted(d.reply_offset for d in divergences(records))
    if offsets:
        out["first_divergence_tokens"] = [offsets[0], offsets[len(offsets) // 2], offsets[-1]]
    return out
