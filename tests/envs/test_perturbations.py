"""Perturbed ground truth: the project's verdict equals bfcl_eval's checker
called directly, and the reward is 0 where the paper's definition says so."""
import pytest

from rcgrpo.envs.replay import replay
from tests.envs.checker import direct_verdict
from tests.envs.variants import perturbations


@pytest.mark.slow  # every perturbation of a category, twice checked (2.5-5 s each)
@pytest.mark.parametrize("category", ["base", "miss_func", "miss_param", "long_context"])
def test_perturbed_verdicts_equal_direct_checker(entries, category):
    checked = 0
    kinds = set()
    mismatches = []
    for entry in [e for e in entries if e.category == category]:
        for name, turns, must_be_zero in perturbations(entry):
            ours = replay(entry, turns)
            theirs = direct_verdict(entry, turns)
            if ours.valid != theirs:
                mismatches.append((entry.id, name, ours.valid, theirs, ours.verdict_error))
            if must_be_zero:
                assert ours.reward == 0.0, (entry.id, name)
            checked += 1
            kinds.add(name)
    assert mismatches == []
    assert checked > 100
    expected = {"dropped_call", "changed_value", "extra_state_call", "swapped_order", "truncated_turns", "emptied_turn"}
    if category == "miss_param":
        expected.add("answer_in_no_call_turn")
    assert expected <= kinds


def test_some_perturbations_still_pass_the_checker(entries):
    # The comparison above must not be trivially "everything is invalid".
    outcomes = set()
    for entry in entries[::25]:
        for _name, turns, _ in perturbations(entry):
            outcomes.add(direct_verdict(entry, turns))
    assert outcomes == {True, False}
