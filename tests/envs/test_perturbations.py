"""Perturbed ground truth: the project's verdict equals bfcl_eval's checker
called directly, and the reward is 0 where the paper's definition says so."""
import copy

import pytest

from rcgrpo.envs.replay import replay
from rcgrpo.envs.reward import ground_truth
from tests.envs.checker import direct_verdict

EXTRA_CALL = {
    "GorillaFileSystem": "touch(file_name='rcgrpo_extra.txt')",
    "TwitterAPI": "post_tweet(content='rcgrpo extra tweet', tags=[], mentions=[])",
    "VehicleControlAPI": "activateParkingBrake(mode='engage')",
    "TicketAPI": "create_ticket(title='rcgrpo extra', description='x', priority=1)",
}


def canonical(entry):
    return ground_truth(entry).canonical_turns()


def as_steps(turns):
    return [[turn] if turn else [] for turn in turns]


def first_turn_with(turns, n):
    return next((i for i, t in enumerate(turns) if len(t) >= n), None)


def unique_in(call, turns):
    return sum(c == call for t in turns for c in t) == 1


def perturbations(entry):
    """(name, turns, paper reward must be 0?) for one entry."""
    gt = canonical(entry)
    out = []
    i = first_turn_with(gt, 1)
    if i is not None:
        t = copy.deepcopy(gt)
        dropped = t[i].pop()
        out.append(("dropped_call", as_steps(t), unique_in(dropped, gt)))
        t = copy.deepcopy(gt)
        call = t[i][-1]
        if "='" in call:
            head, tail = call.split("='", 1)
            t[i][-1] = f"{head}='rcgrpo_changed_{tail}"
            out.append(("changed_value", as_steps(t), unique_in(call, gt)))
    for cls, extra in EXTRA_CALL.items():
        if cls in entry.involved_classes and i is not None:
            t = copy.deepcopy(gt)
            t[i].append(extra)
            out.append(("extra_state_call", as_steps(t), False))
            break
    j = first_turn_with(gt, 2)
    if j is not None:
        t = copy.deepcopy(gt)
        t[j][0], t[j][1] = t[j][1], t[j][0]
        out.append(("swapped_order", as_steps(t), False))
    last_nonempty = max((k for k, turn in enumerate(gt) if turn), default=None)
    out.append(("truncated_turns", as_steps(gt[:-1]), bool(gt[-1]) and all(unique_in(c, gt) for c in gt[-1])))
    if last_nonempty is not None:
        t = copy.deepcopy(gt)
        emptied = t[last_nonempty]
        t[last_nonempty] = []
        out.append(("emptied_turn", as_steps(t), all(unique_in(c, gt) for c in emptied)))
    k = next((k for k, turn in enumerate(gt) if not turn), None)
    if k is not None and i is not None:
        t = copy.deepcopy(gt)
        t[k] = [gt[i][0]]
        out.append(("answer_in_no_call_turn", as_steps(t), False))
    return out


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
