"""Where RCTP's failures come from (`rctp.failure_source`): near misses,
rollouts, and rollouts that part from the expert late; each failure labelled
by executing it, one per expert kept; the first divergent token of each
(expert, failure) pair."""
import dataclasses

import pytest

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.config import ConfigError, parse_args
from rcgrpo.data.divergence import divergences, first_divergence
from rcgrpo.data.expert import expert_turns, near_misses, script_from_turns
from rcgrpo.data.rctp import build_rctp, summary
from rcgrpo.envs.bfcl import load_entries, split_train_test
from rcgrpo.rollout.agent_loop import RolloutConfig
from rcgrpo.rollout.engine import Generation

CFG = RolloutConfig(max_new_tokens=64, max_total_tokens=6144, doc_style="compact_no_response", progress=False)
IDS = ("multi_turn_base_100", "multi_turn_base_104", "multi_turn_base_105")


@pytest.fixture(scope="module")
def entries():
    train, _ = split_train_test(load_entries(["base"]))
    return [e for e in train if e.id in IDS]


def rctp(*flags):
    return parse_args(list(flags), check_files=False).rctp


class ScriptPerEntry:
    """An engine answering each conversation with a fixed script per entry
    (told apart by the first user message in the prompt): a rollout
    source whose failures are known in advance."""

    name = "script-per-entry"
    supports_sleep = False

    def __init__(self, tokenizer, scripts: dict):
        self.tok, self.scripts, self.convs = tokenizer, scripts, []

    def generate(self, prompts, sampling):
        out = []
        for p in prompts:
            p = list(p)
            conv = next((c for c in self.convs if p[:len(c["ids"])] == c["ids"]), None)
            if conv is None:
                text = self.tok.decode(p)
                entry = next(e for e in self.scripts if e.turns[0][0]["content"] in text)
                conv = {"ids": p, "replies": list(self.scripts[entry]), "n": 0}
                self.convs.append(conv)
            reply = conv["replies"][conv["n"]] if conv["n"] < len(conv["replies"]) else "Done."
            conv["n"] += 1
            ids = list(self.tok(reply, add_special_tokens=False)["input_ids"]) + [self.tok.eos_token_id]
            conv["ids"] = p + ids
            out.append([Generation(ids, None, "stop")])
        return out

    def load_weights(self, named):
        pass

    def sleep(self):
        pass

    def wake_up(self):
        pass


def test_near_misses_are_failures_by_execution_one_per_expert(tokenizer, entries):
    records = build_rctp(None, entries, tokenizer, CFG, rctp("--rctp.failure_source", "near_miss"), seed=0)
    experts = [r for r in records if r.kind == "expert"]
    failures = [r for r in records if r.kind != "expert"]
    assert len(experts) == len(failures) == len(entries)
    assert {r.entry_id for r in failures} == {e.id for e in entries}
    assert all(r.kind == "perturbed" and r.reward == 0.0 and r.reward_token == LOW_REWARD for r in failures)
    assert all(r.reward == 1.0 and r.reward_token == HIGH_REWARD for r in experts)
    # Two per expert: each entry's second failure is another mistake than its first.
    two = build_rctp(None, entries, tokenizer, CFG, rctp("--rctp.failure_source", "near_miss",
                                                         "--rctp.failure_ratio", "2"), seed=0)
    failures = [r for r in two if r.kind != "expert"]
    assert len(failures) == 2 * len(entries)
    for e in entries:
        mine = [r.token_ids for r in failures if r.entry_id == e.id]
        assert len(mine) == 2 and mine[0] != mine[1]


def test_near_miss_candidates_change_exactly_one_call(entries):
    for entry in entries:
        truth = expert_turns(entry)
        n = sum(len(t) for t in truth)
        candidates = list(near_misses(entry, seed=0))
        assert len({str(c) for c in candidates}) == len(candidates) >= n  # every call dropped, and changed
        for turns in candidates:
            calls = [c for t in turns for c in t]
            assert len(calls) in (n - 1, n)
            if len(calls) == n:
                assert sum(a != b for a, b in zip(calls, [c for t in truth for c in t])) == 1


def _late_and_early(entry):
    """A failure that parts from the expert in the second turn, and one that
    parts at its first token."""
    turns = expert_turns(entry)
    late = script_from_turns(turns[:1] + [[]] * (len(turns) - 1))
    return late, ["I will not do that."]


def test_late_divergence_keeps_only_failures_that_part_late(tokenizer, entries):
    late, early = _late_and_early(entries[0])
    source = rctp("--rctp.failure_source", "late_divergence", "--rctp.min_divergence_tokens", "8",
                  "--rctp.failure_attempts", "1", "--rctp.fill_with_perturbed", "false")
    engine = ScriptPerEntry(tokenizer, {entries[0]: late, entries[1]: early, entries[2]: early})
    records = build_rctp(engine, entries, tokenizer, CFG, source, seed=0)
    failures = [r for r in records if r.kind == "failure"]
    assert [r.entry_id for r in failures] == [entries[0].id] and failures[0].reward == 0.0
    (pair,) = divergences(records)
    assert pair.entry_id == entries[0].id and pair.reply_offset >= 8
    # As plain rollouts, all three fail and are kept; topped up, the late source fills the quota.
    every = build_rctp(ScriptPerEntry(tokenizer, {entries[0]: late, entries[1]: early, entries[2]: early}),
                       entries, tokenizer, CFG, dataclasses.replace(source, failure_source="rollouts"), seed=0)
    assert sum(r.kind == "failure" for r in every) == 3
    filled = build_rctp(ScriptPerEntry(tokenizer, {entries[0]: late, entries[1]: early, entries[2]: early}),
                        entries, tokenizer, CFG, dataclasses.replace(source, fill_with_perturbed=True), seed=0)
    assert summary(filled)["perturbed_low"] == 2 and summary(filled)["failure_low"] == 1


def test_first_divergence_is_after_the_tag_at_a_generated_token(tokenizer, entries):
    records = build_rctp(None, entries, tokenizer, CFG, rctp("--rctp.failure_source", "near_miss"), seed=0)
    for d in divergences(records):
        expert = next(r for r in records if r.entry_id == d.entry_id and r.kind == "expert")
        assert d.prefix == tuple(expert.token_ids[:len(d.prefix)]) and d.expert_token != d.failure_token
        assert tokenizer.convert_ids_to_tokens(d.prefix[d.tag_at]) == HIGH_REWARD
        assert expert.sampled_mask[len(d.prefix)] == 1
    # The same tag on both records: their first difference is a generated token, nothing to steer.
    expert, failure = records[0], next(r for r in records if r.kind != "expert" and r.entry_id == records[0].entry_id)
    tag = next(i for i, (x, y) in enumerate(zip(expert.token_ids, failure.token_ids)) if x != y)
    same_tag = dataclasses.replace(failure, token_ids=list(failure.token_ids))
    same_tag.token_ids[tag] = expert.token_ids[tag]
    assert first_divergence(expert, failure) is not None and first_divergence(expert, same_tag) is None


def test_unknown_failure_source_is_refused():
    with pytest.raises(ConfigError, match="rctp.failure_source"):
        parse_args(["--rctp.failure_source", "synthetic"], check_files=False)
