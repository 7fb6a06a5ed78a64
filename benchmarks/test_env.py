"""Environment cost: replay of all 800 ground truths through the episode API
and the official verdict. `pytest benchmarks/test_env.py --benchmark-only`."""
from rcgrpo.envs.bfcl import load_entries
from rcgrpo.envs.replay import replay_ground_truth
from rcgrpo.envs.reward import ground_truth

ENTRIES = load_entries()
for _entry in ENTRIES:  # execute each ground truth once: the steady state of training
    ground_truth(_entry)


def replay_all():
    return sum(replay_ground_truth(e).valid for e in ENTRIES)


def test_replay_all_ground_truths(benchmark):
    valid = benchmark.pedantic(replay_all, rounds=3, iterations=1, warmup_rounds=1)
    assert valid == len(ENTRIES) == 800
    per_entry_ms = benchmark.stats.stats.mean / len(ENTRIES) * 1e3
    steps = sum(bool(t) for e in ENTRIES for t in e.ground_truth) + sum(len(e.turns) for e in ENTRIES)
    benchmark.extra_info["per_entry_ms"] = round(per_entry_ms, 3)
    benchmark.extra_info["per_step_ms"] = round(benchmark.stats.stats.mean / steps * 1e3, 4)
    print(f"\n800 ground truths: {per_entry_ms:.2f} ms per entry, "
          f"{benchmark.extra_info['per_step_ms']:.3f} ms per step (episode + reward + official verdict)")
