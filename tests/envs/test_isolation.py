import copy

from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context

from rcgrpo.envs.bfcl import Episode
from rcgrpo.envs.replay import replay, replay_ground_truth
from rcgrpo.envs.reward import ground_truth


def module_state():
    return {k: copy.deepcopy(v) for k, v in vars(long_context).items() if k.isupper()}


def test_two_episodes_of_one_entry_do_not_share_state(by_id):
    entry = by_id["multi_turn_base_0"]
    corrupt = Episode(entry)
    corrupt.step("[cd(folder='document'), rm(file_name='final_report.pdf'), mkdir(dir_name='junk')]")
    clean = Episode(entry)  # started while the corrupted one is still live
    gt = ground_truth(entry)
    for turn in gt.calls:
        if turn:
            clean.step_calls(list(turn))
        if not clean.done:
            clean.end_turn()
    corrupt.finish("test")
    assert clean.result().valid and clean.result().reward == 1.0
    assert corrupt.result().reward == 0.0
    # and a third run after both is unaffected too
    assert replay_ground_truth(entry).reward == 1.0


def test_long_context_module_state_unchanged_by_episodes_and_verdicts(entries):
    before = module_state()
    travel = [e for e in entries if e.category == "long_context" and "TravelAPI" in e.involved_classes]
    assert travel
    for entry in travel[:15]:
        assert replay_ground_truth(entry).valid
        # a corrupted run: book with every card id the extension data has
        ep = Episode(entry)
        ep.step("[cancel_booking(booking_id='3426812'), set_budget_limit(access_token='abc', budget_limit=1.0)]")
        ep.result()
    assert module_state() == before


def test_checker_instance_cache_is_emptied_after_each_verdict(entries):
    for entry in entries[::50]:
        replay_ground_truth(entry)
        replay(entry, [[["ls(a=True)"]]])
    leftovers = [k for k in vars(multi_turn_utils) if k.startswith("rcgrpo_")]
    assert leftovers == []
