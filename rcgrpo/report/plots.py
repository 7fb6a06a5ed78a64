"""The figures of a run, built from its metrics records (``rcgrpo.run.metrics``).

Each builder returns a matplotlib ``Figure`` (None when the run logged
nothing it draws); ``rcgrpo.report.summary`` saves them. ``run_figures`` gives the
set a run leaves:

* ``dashboard``  is RL working: the reward of the step's rollouts by reward
  token, the sampled reward on fixed training prompts (95% interval), the
  zero-variance share of groups, KL, entropy, the clipped share, the engine
  vs trainer log-prob agreement, and RCTP's steer;
* one figure per stage (``rctp``, ``rc-grpo``, ...): what its updates did
  (loss, gradient norm; RCTP's p(expert's token); RL's advantages, reward
  parts, dynamic sampling);
* ``speed``  seconds per step and tokens per second over the whole run.

Every panel follows the same rules, so that it reads at a glance: the y axis
says what and in which unit; step ticks are whole numbers; a log axis when a
positive series spans two decades or more (shares of [0, 1] keep a fixed
linear axis, so runs compare); each series has its own marker and dash, so
lines that coincide stay visible, and the legend says when a series is all
zero or the same as another; a panel that holds several stages puts them
one after another (each with its own step numbers, a dashed line between)
and never over the same step numbers.

Figures use matplotlib's object API (no pyplot): no global state, no
display, and nothing to close.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from rcgrpo.base.stages import FINETUNE_STAGES, RL_STAGES
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.run.metrics import is_number

__all__ = ["Panel", "DASHBOARD", "dashboard_figure", "stage_figure", "speed_figure", "run_figures",
           "LOG_DECADES", "ALL_ZERO", "STAGE_BOUNDARY"]

# A positive series whose largest value is this many decades above its
# smallest is drawn on a log axis: on a linear one the small end is a flat line.
LOG_DECADES = 2.0
ALL_ZERO = "all zero"
STAGE_BOUNDARY = "stage boundary"  # the gid of the dashed line between two stages
PANEL_SIZE = (4.4, 3.2)  # inches, one panel
COLUMNS = 4
# Distinct per series, so that coinciding lines each stay visible.
MARKERS = ("o", "s", "^", "D", "v", "P")
DASHES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
MAX_MARKERS = 25  # per series: beyond this many points, mark every n-th


@dataclass(frozen=True)
class Panel:
    """One axes: a title, a y label with its unit, and (metric, legend label)
    pairs. ``share``: the values are shares of [0, 1], drawn on a fixed
    linear axis. ``footnote``: a metric told in the legend, not drawn, as
    (metric, text with ``{max}``). ``zero_line``: 0 means something (no
    effect), so mark it."""

    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]
    share: bool = False
    footnote: Optional[tuple[str, str]] = None
    zero_line: bool = False
    keys: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "keys", tuple(k for k, _ in self.series))


STEER = Panel("RCTP: steer at the first divergent token", "under high minus under low (nats)",
              (("steer", "log-prob difference"), ("steer_logodds", "log-odds difference")), zero_line=True)
P_EXPERT = Panel("RCTP: p(expert's token) at the first divergent token", "probability",
                 (("p_expert_high", HIGH_REWARD), ("p_expert_low", LOW_REWARD)), share=True)
GRAD_NORM = Panel("gradient norm", "L2 norm before clipping", (("grad_norm", "gradient"),))

# What tells whether RL is working, in reading order.
DASHBOARD = (
    Panel("reward of the step's rollouts by token", "mean reward (0 to 1)",
          (("reward_mean_high", HIGH_REWARD), ("reward_mean_low", LOW_REWARD), ("reward_mean_none", "no token"),
           ("reward_mean", "all rollouts")), share=True),
    # The learning curve: the same prompts every time, so steps compare.
    Panel("sampled reward on fixed training prompts (95% interval)", "share of rollouts with reward 1",
          (("sampled_reward_high", HIGH_REWARD), ("sampled_reward_low", LOW_REWARD),
           ("sampled_reward_none", "no token")), share=True),
    Panel("zero-variance groups (no gradient)", "share of the step's groups", (("zero_var_frac", "groups"),),
          share=True),
    Panel("KL to the reference", "nats per generated token (k3)", (("kl", "KL"),)),
    Panel("policy entropy", "nats per generated token", (("entropy", "entropy"),)),
    Panel("clipped tokens", "share of loss tokens",
          (("clip_frac", "all updates"), ("clip_frac_pass1", "pass 1"), ("clip_frac_pass2", "pass 2"))),
    # How far the engine's sampling log-probs are from the trainer's
    # pre-update ones: near 0 on-policy; a jump means the two disagree.
    Panel("engine vs trainer log-probs", "|engine - trainer| (nats)",
          (("logp_diff_abs_mean", "mean per token"), ("seq_log_ratio_abs_max", "max per sequence")),
          footnote=("logp_diff_over_0.1_frac", "tokens off by > 0.1 nats")),
    STEER,
)
FINETUNE_PANELS = (
    Panel("loss", "cross-entropy (nats per token)", (("loss", "loss"),)),
    GRAD_NORM, STEER, P_EXPERT,
)
RL_PANELS = (
    Panel("loss", "policy loss per token (no unit)", (("loss", "loss"),)),
    GRAD_NORM,
    Panel("advantages", "advantage (no unit)", (("adv_std", "std"), ("adv_abs_mean", "mean |advantage|"))),
    Panel("reward parts", "share of rollouts",
          (("r_state_mean", "state matches"), ("r_action_mean", "calls match"), ("valid_frac", "valid replies")),
          share=True),
    Panel("dynamic sampling", "count per step", (("ds_prompts_drawn", "prompts drawn"),
                                                  ("ds_groups_kept", "groups kept"),
                                                  ("ds_groups_dropped", "groups dropped"))),
    Panel("truncated importance sampling", "share of loss tokens", (("tis_capped_frac", "weight capped"),)),
)
SPEED_PANELS = (
    Panel("time per step", "seconds per step", (("rollout_s", "rollouts"), ("update_s", "update"))),
    Panel("throughput", "tokens per second", (("tokens_per_s", "trained"), ("generated_tokens_per_s", "generated"))),
)


# ------------------------------------------------------------------ records


def _stage_name(stage: Optional[str]) -> str:
    return stage or "run"


def _series(records: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """stage -> (steps, values) for one metric, in file order; NaN kept (a gap)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        v = r.get(key)
        if is_number(v) and not math.isinf(v):
            xs, ys = out.setdefault(_stage_name(r.get("stage")), ([], []))
            xs.append(r["step"])
            ys.append(float(v))
    return out


def _stage_spans(records: list[dict]) -> dict[str, tuple[int, int]]:
    """stage -> (first step, last step), stages in the order they ran."""
    spans: dict[str, tuple[int, int]] = {}
    for r in records:
        name = _stage_name(r.get("stage"))
        lo, hi = spans.get(name, (r["step"], r["step"]))
        spans[name] = (min(lo, r["step"]), max(hi, r["step"]))
    return spans


def _has_data(records: list[dict], panel: Panel) -> bool:
    return any(_series(records, k) for k in panel.keys)


# ------------------------------------------------------------------ drawing


class _StageAxis:
    """The x axis of a panel that holds one or more stages: each stage keeps
    its own step numbers (the tick labels) and follows the one before it."""

    def __init__(self, spans: dict[str, tuple[int, int]]):
        self.offset: dict[str, int] = {}
        self.spans = spans
        end = None
        for name, (first, last) in spans.items():
            self.offset[name] = 0 if end is None else end + 1 - first
            end = self.offset[name] + last

    def x(self, stage: str, steps: list[int]) -> list[int]:
        return [s + self.offset[stage] for s in steps]

    def boundaries(self) -> list[float]:
        """Between the last step of a stage and the first of the next."""
        return [self.offset[name] + first - 0.5 for name, (first, _) in list(self.spans.items())[1:]]

    def local_step(self, x: float) -> float:
        stage = next(iter(self.spans))
        for name, (first, _) in self.spans.items():
            if x >= self.offset[name] + first - 0.5:
                stage = name
        return x - self.offset[stage]


def _log_axis(values: list[float]) -> bool:
    """A signed series stays linear; a positive one spanning LOG_DECADES or
    more goes log (its zeros are then not drawn, and the legend says so)."""
    if any(v < 0 for v in values):
        return False
    positive = [v for v in values if v > 0]
    return bool(positive) and math.log10(max(positive) / min(positive)) >= LOG_DECADES


def _draw(ax, records: list[dict], panel: Panel, spans: dict[str, tuple[int, int]]) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    data = [(key, label, _series(records, key)) for key, label in panel.series]
    data = [d for d in data if d[2]]
    stages = [s for s in spans if any(s in series for _, _, series in data)]
    axis = _StageAxis({s: spans[s] for s in stages})
    values = [v for _, _, series in data for _, ys in series.values() for v in ys if not math.isnan(v)]
    log = not panel.share and _log_axis(values)

    drawn: list[tuple[str, dict]] = []
    noted = False  # a legend entry says more than the series' name
    for i, (key, name, series) in enumerate(data):
        label = name
        ys_all = [v for _, ys in series.values() for v in ys if not math.isnan(v)]
        same_as = next((other for other, s in drawn if s == series), None)
        if ys_all and all(v == 0 for v in ys_all):
            label += f" ({ALL_ZERO})"
        elif same_as is not None:
            label += f" (same as {same_as} at every step)"
        zeros = sum(v <= 0 for v in ys_all) if log else 0
        if zeros:
            label += f" ({zeros} zero value{'s' * (zeros > 1)}: below the log axis)"
        noted |= label != name
        drawn.append((name, series))
        for j, (stage, (xs, ys)) in enumerate(series.items()):
            line, = ax.plot(axis.x(stage, xs), ys, color=f"C{i}", marker=MARKERS[i % len(MARKERS)],
                            linestyle=DASHES[i % len(DASHES)], markersize=4, label=label if j == 0 else None,
                            markevery=max(1, len(xs) // MAX_MARKERS))
            band = [_series(records, f"{key}_{end}").get(stage) for end in ("lo", "hi")]
            if all(band) and band[0][0] == band[1][0] == xs:  # an interval logged with the value: shade it
                ax.fill_between(axis.x(stage, xs), band[0][1], band[1][1], color=line.get_color(), alpha=0.15)
    if panel.footnote:
        key, text = panel.footnote
        told = [v for _, ys in _series(records, key).values() for v in ys if not math.isnan(v)]
        if told:  # a legend entry without a line
            ax.plot([], [], linestyle="none", label=f"{text}: " + (ALL_ZERO if max(told) == 0 else
                                                                    f"at most {max(told):.1%}"))
            noted = True

    # Stage names sit just above the axes; the title goes above them.
    ax.set_title(panel.title, fontsize=10, pad=14 if len(stages) > 1 else 6)
    ax.set_ylabel(panel.ylabel)
    if panel.share:
        ax.set_ylim(-0.05, 1.05)
    elif values and all(v == 0 for v in values):  # nothing to scale to: keep 0 near the bottom, not centred
        ax.set_ylim(-0.1, 1.0)
    elif log:
        ax.set_yscale("log")
    if panel.zero_line:
        ax.axhline(0, color="0.3", linewidth=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    if len(stages) == 1:
        ax.set_xlabel(f"{stages[0]} step")
    else:
        ax.set_xlabel("step of each stage (" + " | ".join(stages) + ")")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{axis.local_step(x):.0f}"))
        for x in axis.boundaries():
            ax.axvline(x, color="0.4", linestyle="--", linewidth=0.8, gid=STAGE_BOUNDARY)
        for name, (first, last) in axis.spans.items():
            mid = axis.offset[name] + (first + last) / 2
            ax.text(mid, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8,
                    color="0.3")
    ax.grid(alpha=0.3)
    # A panel of one series says what it is in its title; a panel of several
    # names the one drawn even when the others were not logged.
    if len(panel.series) > 1 or noted:
        ax.legend(fontsize=7)


def _figure(records: list[dict], panels: tuple[Panel, ...], title: str, spans=None):
    """A grid of the panels that have data; None when none has."""
    from matplotlib.figure import Figure

    panels = tuple(p for p in panels if _has_data(records, p))
    if not panels:
        return None
    spans = spans or _stage_spans(records)
    # Up to COLUMNS in one row; more in two rows of equal length (the last may be one short).
    cols = len(panels) if len(panels) <= COLUMNS else math.ceil(len(panels) / 2)
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(PANEL_SIZE[0] * cols, PANEL_SIZE[1] * rows + 0.4), dpi=100, layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, panel in zip(axes, panels):
        _draw(ax, records, panel, spans)
    for ax in axes[len(panels):]:
        fig.delaxes(ax)
    fig.suptitle(title)
    return fig


def dashboard_figure(records: list[dict], run_name: str = ""):
    """Is RL working: DASHBOARD's panels that the run logged; None for a run
    without RL (its fine-tuning stage's figure has the steer)."""
    if not any(_has_data(records, p) for p in DASHBOARD if p is not STEER):
        return None
    return _figure(records, DASHBOARD, f"Is RL working? {run_name}".strip())


def stage_figure(records: list[dict], stage: str):
    """What one stage's updates did; the panels follow its kind (fine-tuning
    or RL; a stage of another name is RL when it logged rollout rewards)."""
    own = [r for r in records if _stage_name(r.get("stage")) == stage]
    rl = stage in RL_STAGES or (stage not in FINETUNE_STAGES and any("reward_mean" in r for r in own))
    return _figure(own, RL_PANELS if rl else FINETUNE_PANELS, f"stage {stage}: its updates")


def speed_figure(records: list[dict]):
    """Seconds per step and tokens per second, every stage in order."""
    return _figure(records, SPEED_PANELS, "speed")


def run_figures(records: list[dict], run_name: str = "") -> dict:
    """name -> Figure, for every figure the run has data for, in reading
    order; a name is safe as a file name."""
    figures = {"dashboard": dashboard_figure(records, run_name)}
    for i, stage in enumerate(_stage_spans(records)):
        # A stage is named by the metrics file, which can hold anything.
        plain = re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,39}", stage) and stage not in ("dashboard", "speed")
        figures[stage if plain else f"stage-{i + 1}"] = stage_figure(records, stage)
    figures["speed"] = speed_figure(records)
    return {name: fig for name, fig in figures.items() if fig is not None}
