"""Ways a trajectory can differ from an entry's ground truth, as recorded
call strings (`turns[t][s]`: the calls of step s of turn t), for comparing
the project's reward and verdict with the official checker's."""
import copy

from rcgrpo.envs.reward import ground_truth

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
    """(name, turns, paper reward must be 0?) for one entry: one call
    dropped or changed, an extra state-changing call, two calls swapped, the
    last turn cut or emptied, an answer where no call was due, and every
    call made to fail (an unexpected keyword: each raises TypeError)."""
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
    out.append(("truncated_turns", as_steps(gt[:-1]), True))  # cut short: never rewarded
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
    if i is not None:
        out.append(("every_call_failing", every_call_failing(entry), True))
    return out


UNEXPECTED_KEYWORD = "rcgrpo_unexpected=1"


def with_unexpected_keyword(call: str) -> str:
    """`f(a=1)` -> `f(a=1, rcgrpo_unexpected=1)`: the same call, which now
    raises before it does anything."""
    head = call[:-1]
    return f"{head}{UNEXPECTED_KEYWORD})" if head.endswith("(") else f"{head}, {UNEXPECTED_KEYWORD})"


def every_call_failing(entry):
    gt = canonical(entry)
    return as_steps([[with_unexpected_keyword(c) for c in turn] for turn in gt])
