"""rcgrpo.report.plots: the rules that make a figure readable at a glance, checked
on the Figure objects (no PNG is written)."""

from __future__ import annotations

import math

import pytest

from rcgrpo.report.plots import (
    ALL_ZERO,
    DASHBOARD,
    STAGE_BOUNDARY,
    dashboard_figure,
    run_figures,
    speed_figure,
    stage_figure,
)


def two_stage_run(rl_steps=4, **rl_overrides):
    """RCTP steps 0-5 (step 0: the steer before training), then RC-GRPO
    steps 0..rl_steps (step 0: the sampled-reward probe only)."""
    recs = [{"stage": "rctp", "step": 0, "steer": 0.01, "steer_logodds": 0.01, "p_expert_high": 0.1,
             "p_expert_low": 0.1}]
    for s in range(1, 6):
        recs.append({"stage": "rctp", "step": s, "loss": 3.0 / s, "grad_norm": 10.0 / s, "tokens_per_s": 550.0 + s,
                     "update_s": 15.0, "steer": 0.1 * s, "steer_logodds": 0.12 * s, "p_expert_high": 0.1 + 0.1 * s,
                     "p_expert_low": 0.1 + 0.09 * s})
    recs.append({"stage": "rc-grpo", "step": 0, "sampled_reward_high": 0.4, "sampled_reward_high_lo": 0.2,
                 "sampled_reward_high_hi": 0.6, "sampled_reward_low": 0.3, "sampled_reward_low_lo": 0.1,
                 "sampled_reward_low_hi": 0.5})
    for s in range(1, rl_steps + 1):
        rec = {"stage": "rc-grpo", "step": s, "reward_mean": 0.5, "reward_mean_high": 0.6, "reward_mean_low": 0.4,
               "zero_var_frac": 0.5, "kl": 0.01 * s, "entropy": 0.2 + 0.01 * s, "clip_frac": 0.0,
               "logp_diff_abs_mean": 2e-6, "seq_log_ratio_abs_max": 3e-4, "logp_diff_over_0.1_frac": 0.0,
               "loss": 1e-3 * s, "grad_norm": 1.0, "adv_std": 1.0, "adv_abs_mean": 0.8, "r_state_mean": 0.8,
               "r_action_mean": 0.5, "valid_frac": 0.5, "tokens_per_s": 800.0, "generated_tokens_per_s": 30.0,
               "rollout_s": 12.0, "update_s": 20.0}
        recs.append({**rec, **{k: v(s) if callable(v) else v for k, v in rl_overrides.items()}})
    recs.append({**recs[-1], "step": rl_steps + 1, "sampled_reward_high": 0.8, "sampled_reward_high_lo": 0.6,
                 "sampled_reward_high_hi": 0.9, "sampled_reward_low": 0.7, "sampled_reward_low_lo": 0.5,
                 "sampled_reward_low_hi": 0.85})
    return recs


def panel(fig, title):
    found = [ax for ax in fig.axes if ax.get_title() == title]
    assert len(found) == 1, [ax.get_title() for ax in fig.axes]
    return found[0]


def legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_every_panel_has_a_unit_and_whole_step_ticks():
    # RL steps 1-3: a plain locator would tick 1.5; dynamic sampling makes RL's figure 5 panels (grid of 6).
    figures = run_figures(two_stage_run(rl_steps=2, ds_groups_kept=8), "demo")
    assert list(figures) == ["dashboard", "rctp", "rc-grpo", "speed"]
    assert len(figures["rc-grpo"].axes) == 5
    for name, fig in figures.items():
        for ax in fig.axes:
            where = f"{name}: {ax.get_title()}"
            assert ax.get_ylabel() and ax.get_xlabel() and ax.get_title(), where
            ticks = ax.get_xticks()
            assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (where, ticks)


def test_the_dashboard_holds_what_tells_whether_rl_works():
    fig = dashboard_figure(two_stage_run(), "demo")
    assert [ax.get_title() for ax in fig.axes] == [p.title for p in DASHBOARD]
    assert len(fig.axes) == 8 and "demo" in fig.get_suptitle()
    # Panels of one stage count that stage's own steps.
    assert panel(fig, "RCTP: steer at the first divergent token").get_xlabel() == "rctp step"
    assert panel(fig, "policy entropy").get_xlabel() == "rc-grpo step"
    # The sampled reward's 95% interval is shaded, one band per token.
    assert len(panel(fig, DASHBOARD[1].title).collections) == 2
    # A run without RL has no dashboard; RCTP's steer is in its stage's figure.
    rctp = [r for r in two_stage_run() if r["stage"] == "rctp"]
    assert dashboard_figure(rctp) is None and list(run_figures(rctp)) == ["rctp", "speed"]
    figures = run_figures(rctp)
    assert "RCTP: steer at the first divergent token" in [ax.get_title() for ax in figures["rctp"].axes]
    # Of a panel's series only one was logged (no rollouts in RCTP): the legend says which.
    assert legend_texts(panel(figures["speed"], "time per step")) == ["update"]
    assert panel(figures["rctp"], "gradient norm").get_legend() is None  # one series: the title says it


def test_a_log_axis_where_values_span_two_decades():
    fig = dashboard_figure(two_stage_run())
    assert panel(fig, "engine vs trainer log-probs").get_yscale() == "log"  # 2e-6 beside 3e-4
    assert panel(fig, "policy entropy").get_yscale() == "linear"
    assert panel(fig, "KL to the reference").get_yscale() == "linear"  # 0.01 .. 0.04
    # A share keeps its fixed [0, 1] axis whatever its values.
    tiny = dashboard_figure(two_stage_run(zero_var_frac=lambda s: 10.0 ** -s))
    zero_var = panel(tiny, "zero-variance groups (no gradient)")
    assert zero_var.get_yscale() == "linear" and zero_var.get_ylim() == (-0.05, 1.05)
    # Zeros on a log axis are not drawn: the legend says how many.
    kl = panel(dashboard_figure(two_stage_run(kl=lambda s: 0.0 if s == 1 else 10.0 ** -s)), "KL to the reference")
    assert kl.get_yscale() == "log" and legend_texts(kl) == ["KL (1 zero value: below the log axis)"]
    # A signed series spanning decades stays linear: a log axis would drop its sign.
    loss = panel(stage_figure(two_stage_run(loss=lambda s: (-1) ** s * 10.0 ** -s), "rc-grpo"), "loss")
    assert loss.get_yscale() == "linear"


def test_coinciding_series_are_told_apart():
    fig = dashboard_figure(two_stage_run())
    clip = panel(fig, "clipped tokens")
    assert legend_texts(clip) == [f"all updates ({ALL_ZERO})"]
    agreement = panel(fig, "engine vs trainer log-probs")
    assert legend_texts(agreement)[-1] == f"tokens off by > 0.1 nats: {ALL_ZERO}"
    parts = panel(stage_figure(two_stage_run(), "rc-grpo"), "reward parts")
    assert "valid replies (same as calls match at every step)" in legend_texts(parts)
    # Each series has its own marker and dash, so one drawn over another still shows.
    lines = [line for line in parts.get_lines() if line.get_label() in legend_texts(parts)]
    assert len({line.get_marker() for line in lines}) == len({str(line.get_linestyle()) for line in lines}) == 3


def test_stages_follow_one_another_with_a_boundary_between():
    fig = speed_figure(two_stage_run())
    for ax in fig.axes:
        boundaries = [line for line in ax.get_lines() if line.get_gid() == STAGE_BOUNDARY]
        assert len(boundaries) == 1, ax.get_title()
        x_boundary = boundaries[0].get_xdata()[0]
        data = [line for line in ax.get_lines() if line.get_gid() != STAGE_BOUNDARY]
        before = [x for line in data for x in line.get_xdata() if x < x_boundary]
        after = [x for line in data for x in line.get_xdata() if x > x_boundary]
        assert before and after  # both stages drawn, on either side of the line
        # The ticks read each stage's own steps: rc-grpo starts again at 0.
        fmt = ax.xaxis.get_major_formatter()
        assert fmt(math.ceil(x_boundary)) == "0" and fmt(math.floor(x_boundary)) == "5"
        assert ax.get_xlabel() == "step of each stage (rctp | rc-grpo)"


@pytest.mark.parametrize("stage", ["../escape", "dashboard", "A B"])
def test_a_stage_name_from_the_file_is_never_a_path(stage):
    recs = [{"stage": stage, "step": s, "loss": 1.0 / s} for s in (1, 2)]
    assert list(run_figures(recs)) == ["stage-1"]
