from collections import Counter

import pytest

from rcgrpo.envs.replay import replay_ground_truth
from rcgrpo.envs.reward import ground_truth
from tests.envs.checker import direct_verdict


@pytest.mark.slow  # replays every entry's ground truth (~2.5 s)
def test_every_ground_truth_is_valid_with_reward_one(entries):
    failures = []
    for entry in entries:
        result = replay_ground_truth(entry)
        if not (result.valid and result.reward == 1.0 and result.end_reason == "completed"):
            failures.append((entry.id, result.valid, result.r_state, result.r_action, result.verdict_error))
    assert failures == []


def test_canonical_ground_truth_passes_the_checker_directly(entries):
    # The keyword form the project feeds the checker is itself accepted.
    for entry in entries[::10]:
        assert direct_verdict(entry, [[turn] if turn else [] for turn in ground_truth(entry).canonical_turns()])


def test_official_decoding_drops_positional_arguments(by_id):
    # base_0 turn 2 is "sort('final_report.pdf')": the official decoder turns
    # a model's positional argument into sort(), so the entry fails.
    entry = by_id["multi_turn_base_0"]
    from rcgrpo.envs.replay import replay

    raw = [[list(turn)] if turn else [] for turn in entry.ground_truth]
    official = replay(entry, raw, positional="drop")
    tolerant = replay(entry, raw, positional="bind")
    assert not official.valid and tolerant.valid and tolerant.reward == 1.0
    assert "sort()" in official.executed_calls
    # and the verdict is the checker's own on the positional-free strings
    dropped = [[[s.replace("sort('final_report.pdf')", "sort()") for s in turn]] for turn in entry.ground_truth]
    assert direct_verdict(entry, dropped) is False


def test_positional_ground_truth_calls_exist():
    # Guard for the test above: the data really has positional ground truth.
    from rcgrpo.envs.data import load_entries

    count = Counter(
        "(" in s and "=" not in s.split("(", 1)[1].split(",")[0]
        for e in load_entries(["base"]) for t in e.ground_truth for s in t if not s.endswith("()")
    )
    assert count[True] > 10
