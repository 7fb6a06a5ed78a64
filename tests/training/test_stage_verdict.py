"""The figures on a stage's bar and the line that ends the stage."""
import math

from rcgrpo.training.stage_verdict import FINETUNE_FIGURES, RL_FIGURES, StageTally, bar_figures


def rl_step(reward, high, low, zero_var, skipped=0, **more):
    return {"reward_mean": reward, "reward_mean_high": high, "reward_mean_low": low, "zero_var_frac": zero_var,
            "kl": 0.00123456, "update_skipped": skipped, **more}


def test_the_bar_shows_what_the_record_has_in_three_digits():
    assert bar_figures(rl_step(0.4375, 0.5, 0.375, 0.25), RL_FIGURES) == \
        {"reward": "0.438", "high": "0.5", "low": "0.375", "zero_var": "0.25", "kl": "0.00123"}
    # a stage without reward tokens, a non-finite or missing figure: left out
    assert bar_figures({"reward_mean": 1.0, "zero_var_frac": math.nan, "kl": True}, RL_FIGURES) == {"reward": "1"}
    assert bar_figures({"loss": 2.0}, FINETUNE_FIGURES) == {"loss": "2"}


def test_an_rl_stage_that_learned_says_how_far():
    tally = StageTally("rc-grpo", rl=True)
    for record in (rl_step(0.4, 0.5, 0.3, 0.6), rl_step(0.6, 0.7, 0.5, 0.4, skipped=1), rl_step(0.8, 0.9, 0.7, 0.2)):
        tally.add(record)
    assert tally.lines() == ["[rc-grpo] done: 3 steps; rollout reward 0.4 -> 0.8 (high 0.5 -> 0.9, low 0.3 -> 0.7); "
                             "zero-variance groups 40% on average; 2 of 3 steps updated the weights"]


def test_an_rl_stage_whose_groups_never_varied_is_warned_about():
    tally = StageTally("grpo", rl=True)
    for _ in range(2):
        tally.add({"reward_mean": 0.0, "zero_var_frac": 1.0, "kl": 0.01, "update_skipped": 0})
    verdict, warning = tally.lines()
    assert verdict.startswith("[grpo] done: 2 steps; rollout reward 0 -> 0;")
    assert warning.startswith("[grpo] WARNING: learned nothing from its rewards")
    # One step with variance (or groups dynamic sampling kept) is enough to learn from.
    tally.add({"reward_mean": 0.5, "zero_var_frac": 0.5, "update_skipped": 0})
    assert len(tally.lines()) == 1
    kept = StageTally("grpo", rl=True)
    kept.add({"reward_mean": 0.0, "zero_var_frac": 1.0, "ds_groups_kept": 2, "update_skipped": 0})
    assert len(kept.lines()) == 1


def test_an_rl_stage_that_never_updated_is_warned_about():
    tally = StageTally("grpo", rl=True)
    tally.add({"reward_mean": 0.5, "zero_var_frac": 0.5, "update_skipped": 1})
    verdict, warning = tally.lines()
    assert "0 of 1 steps updated the weights" in verdict
    assert warning == ("[grpo] WARNING: learned nothing: no step changed the weights (every update was skipped: "
                       "no loss token carried a gradient)")


def test_fine_tuning_and_a_stage_with_nothing_left():
    tally = StageTally("rctp", rl=False)
    tally.add({"loss": 2.5})
    assert tally.lines() == ["[rctp] done: 1 step; loss 2.5"]
    tally.add({"loss": 0.75})
    assert tally.lines() == ["[rctp] done: 2 steps; loss 2.5 -> 0.75"]
    assert StageTally("rc-grpo", rl=True).lines() == ["[rc-grpo] done: 0 steps (nothing left to do)"]


def test_the_last_line_carries_the_tree_parity_checks():
    tally = StageTally("rctp", rl=False)
    tally.add({"loss": 2.5, "tree_parity_max_abs": 3e-6, "tree_parity_s": 0.5})
    tally.add({"loss": 2.0})
    assert tally.lines() == ["[rctp] done: 2 steps; loss 2.5 -> 2; tree parity max 3e-06 nats (1 check, 0.5 s)"]
    rl = StageTally("grpo", rl=True)
    for figure in (0.1, 0.3):
        rl.add({"reward_mean": 0.5, "zero_var_frac": 0.5, "update_skipped": 0, "tree_parity_max_abs": figure,
                "tree_parity_s": 1.0})
    assert rl.lines()[0].endswith("; 2 of 2 steps updated the weights; tree parity max 0.3 nats (2 checks, 2.0 s)")
