"""The study's reading of the paper's training-dynamics claims
(benchmarks/learning.py): synthetic arms whose answer is known."""
import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("learning", Path(__file__).parents[2] / "benchmarks" / "learning.py")
learning = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(learning)


def arm(zero_var: float, entropy: float, final: float, steps: int = 30) -> dict:
    rows = [{"step": s, "zero_var_frac": zero_var, "entropy": entropy + 0.01 * (s % 3), "adv_abs_mean": 0.5,
             "reward_mean": 0.1 + 0.02 * s} for s in range(1, steps + 1)]
    probe = {"step": steps, "mean": final, "ci": [final - 0.05, final + 0.05], "n": 64}
    return {"steps": rows, "probes": {"high": [probe]}}


@pytest.mark.parametrize("swap", [False, True])
def test_the_claims_read_the_arms_each_way(swap):
    good, bad = arm(zero_var=0.0, entropy=0.3, final=0.8), arm(zero_var=1.0, entropy=0.6, final=0.4)
    rc, plain = (bad, good) if swap else (good, bad)
    dyn = learning.dynamics({"rctp+rc-grpo": rc, "rctp+grpo": plain}, groups_per_step=2)
    assert dyn["rc-grpo"]["zero_var"]["n"] == 60 and dyn["rc-grpo"]["zero_var"]["k"] == (60 if swap else 0)
    assert dyn["claim_zero_var"] == ("higher" if swap else "lower")
    assert dyn["claim_entropy"] == ({"entropy": "higher", "reward": "lower"} if swap
                                    else {"entropy": "lower", "reward": "higher"})
    assert dyn["rc-grpo"]["entropy_reward_corr"] is not None
    assert "RCTP + RC-GRPO" in "\n".join(learning.dynamics_report(dyn))


def test_equal_arms_are_not_told_apart_and_one_arm_is_not_compared():
    a = arm(zero_var=0.5, entropy=0.4, final=0.5)
    dyn = learning.dynamics({"rctp+rc-grpo": a, "rctp+grpo": a}, groups_per_step=2)
    assert dyn["claim_zero_var"] == "not distinguishable"
    assert dyn["claim_entropy"] == {"entropy": "overlapping", "reward": "overlapping"}
    assert learning.dynamics({"rctp+rc-grpo": a}, groups_per_step=2) is None


def test_running_mean():
    assert learning.running_mean([1, 0, 1, 0, 1, 0], window=2) == [1, 0.5, 0.5, 0.5, 0.5, 0.5]


def test_a_probe_the_engine_faulted_on_is_found_and_replaced_by_its_re_measure():
    """The probe at step 2 was played by the engine whose next rollouts (step
    3, same weights) came back with NaN log-probs; the one at step 4 was not."""
    nan = float("nan")
    rows = [{"step": 0, "sampled_reward_high": 0.5, "sampled_reward_high_lo": 0.4, "sampled_reward_high_hi": 0.6,
             "sampled_reward_high_n": 64}]
    for s, diff in ((1, 0.0), (2, 0.0), (3, nan), (4, 0.0), (5, 0.0)):
        rows.append({"step": s, "reward_mean": 0.5, "zero_var_frac": 0.0, "entropy": 0.3, "logp_diff_abs_mean": diff})
    for s in (2, 4):
        rows[s].update(sampled_reward_high=0.05, sampled_reward_high_lo=0.0, sampled_reward_high_hi=0.1,
                       sampled_reward_high_n=64)
    assert learning.faulty_probe_steps(rows) == [2]
    arm = learning.summarise_arm(rows, "high", {2: {"high": {"k": 32, "n": 64}}})
    probe = {p["step"]: p for p in arm["probes"]["high"]}
    assert probe[2]["mean"] == 0.5 and probe[2]["played_by_fault"] == 0.05 and probe[2]["n"] == 64
    assert probe[4]["mean"] == 0.05 and "played_by_fault" not in probe[4]
    assert arm["remeasured"] == [2] and arm["engine_fault"] == [3]
