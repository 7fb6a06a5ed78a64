import random
from collections import Counter

from rcgrpo.envs.split import NUM_TEST_IDS, recorded_test_ids, split_train_test

SPLIT_SEED = 20260203  # the paper's arXiv month; any fixed value works


def held_out_ids(entries, seed: int = SPLIT_SEED, k: int = NUM_TEST_IDS) -> list[int]:
    """How rcgrpo/envs/test_split.json's held-out ids were drawn: k numeric ids,
    seeded, from the ids present in the data."""
    ids = sorted({e.index for e in entries})
    if len(ids) < k:
        raise ValueError(f"only {len(ids)} distinct ids, cannot hold out {k}")
    return sorted(random.Random(seed).sample(ids, k))


def test_split_is_720_80_and_ids_stay_on_one_side(entries):
    train, test = split_train_test(entries)
    assert (len(train), len(test)) == (720, 80)
    assert not {e.index for e in train} & {e.index for e in test}
    assert Counter(e.category for e in test) == {c: NUM_TEST_IDS for c in
                                                 ("base", "miss_func", "miss_param", "long_context")}


def test_recorded_test_ids_are_the_seeded_function_of_the_data(entries):
    assert held_out_ids(entries) == recorded_test_ids()
    assert held_out_ids(list(reversed(entries))) == recorded_test_ids()  # order-free
    assert held_out_ids(entries, seed=1) != recorded_test_ids()
