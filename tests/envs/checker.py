"""A direct, isolated call of bfcl_eval's checker: the oracle the tests
compare the project's verdict with."""
import uuid

from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

from rcgrpo.envs.reward import restore_long_context_state


def direct_verdict(entry, turns):
    """What the official runner + checker say about decoded call strings."""
    if len(turns) != len(entry.ground_truth):
        return False  # the runner's force-terminated case
    key = f"direct_{uuid.uuid4().hex}"
    try:
        return bool(multi_turn_checker(turns, entry.ground_truth, entry.as_bfcl_test_entry(),
                                       entry.category, key)["valid"])
    finally:
        for name in [n for n in vars(multi_turn_utils) if n.startswith(key)]:
            del vars(multi_turn_utils)[name]
        restore_long_context_state()
