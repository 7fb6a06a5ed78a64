"""Environment cost: replay of the BFCL ground truths through the episode
API and the official verdict (all 800 entries; smoke: every 20th), after one
execution of each ground truth (the steady state of training). Reported,
not held: ms per entry and per step (episode + reward + official verdict).
"""
import pytest

from benchmarks import scale
from benchmarks.scoreboard import Figure
from rcgrpo.envs.bfcl import load_entries
from rcgrpo.envs.replay import replay_ground_truth
from rcgrpo.envs.reward import ground_truth

ENTRIES = load_entries()[::scale.pick(smoke=20, quick=1)]
ROUNDS = scale.pick(smoke=1, quick=3)
pytestmark = pytest.mark.benchmark(group="environment: ground-truth replay")


@pytest.fixture(scope="module", autouse=True)
def executed_once():
    for entry in ENTRIES:
        ground_truth(entry)


def replay_all():
    return sum(replay_ground_truth(e).valid for e in ENTRIES)


def test_replay_all_ground_truths(benchmark, board):
    valid = benchmark.pedantic(replay_all, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    assert valid == len(ENTRIES)
    steps = sum(bool(t) for e in ENTRIES for t in e.ground_truth) + sum(len(e.turns) for e in ENTRIES)
    mean = benchmark.stats.stats.mean
    benchmark.extra_info.update(per_entry_ms=1e3 * mean / len(ENTRIES), per_step_ms=1e3 * mean / steps)
    shape = f"{len(ENTRIES)} entries, {steps} steps, mean of {ROUNDS}"
    board.record(Figure(group="environment", name="ground-truth replay + official verdict, per entry",
                        value=1e3 * mean / len(ENTRIES), unit="ms", shape=shape))
    board.record(Figure(group="environment", name="ground-truth replay + official verdict, per step",
                        value=1e3 * mean / steps, unit="ms", shape=shape))
