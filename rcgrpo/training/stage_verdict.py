"""What a person watches while a training stage runs, and the line that ends it.

A stage's bar carries the figures that tell whether it is working (RL: the
sampled reward, overall and under each reward token, the share of groups
whose rewards were all equal, the KL to the reference; fine-tuning: the
loss). When the stage ends, one line says what it did, from its first step
to its last; an RL stage that cannot have learned from its rewards (every
group of every step had equal rewards, so no advantage; or no step changed
the weights) gets a warning line beside it, since its metrics would
otherwise look merely flat.
"""
from __future__ import annotations

from typing import Mapping

from rcgrpo.run.metrics import is_finite_number

# metric key -> its name on the bar
RL_FIGURES = {"reward_mean": "reward", "reward_mean_high": "high", "reward_mean_low": "low",
              "zero_var_frac": "zero_var", "kl": "kl"}
FINETUNE_FIGURES = {"loss": "loss"}


def _number(value) -> float | None:
    return float(value) if is_finite_number(value) else None


def bar_figures(record: Mapping, figures: Mapping[str, str]) -> dict[str, str]:
    """The figures of a step's metrics record, as the bar shows them (those
    the record has)."""
    out = {}
    for key, name in figures.items():
        value = _number(record.get(key))
        if value is not None:
            out[name] = f"{value:.3g}"
    return out


def _informative(record: Mapping) -> bool:
    """Whether some group of the step had reward variance: among the
    scheduled prompts, or among those dynamic sampling drew and kept."""
    zero_var = _number(record.get("zero_var_frac"))
    return (zero_var is not None and zero_var < 1) or (_number(record.get("ds_groups_kept")) or 0) > 0


class StageTally:
    """Collects a stage's step records (this invocation's) for its verdict."""

    def __init__(self, stage: str, rl: bool):
        self.stage, self.rl = stage, rl
        self.records: list[Mapping] = []

    def add(self, record: Mapping) -> None:
        self.records.append(record)

    def _values(self, key: str) -> list[float]:
        """The stage's finite values of `key`, step by step."""
        return [v for v in (_number(r.get(key)) for r in self.records) if v is not None]

    def _change(self, key: str) -> str | None:
        values = self._values(key)
        if not values:
            return None
        return f"{values[0]:.3g} -> {values[-1]:.3g}" if len(values) > 1 else f"{values[0]:.3g}"

    def _parity(self) -> list[str]:
        """The tree parity checks the stage ran (rcgrpo.training.parity), so
        that their figure and their cost show at its end too."""
        figures, seconds = self._values("tree_parity_max_abs"), self._values("tree_parity_s")
        if not figures:
            return []
        checks = f"{len(figures)} check{'s' if len(figures) != 1 else ''}"
        return [f"tree parity max {max(figures):.2g} nats ({checks}, {sum(seconds):.1f} s)"]

    def lines(self) -> list[str]:
        """The verdict, and a warning where the stage cannot have learned."""
        n = len(self.records)
        head = f"[{self.stage}] done: {n} step{'s' if n != 1 else ''}"
        if n == 0:
            return [f"{head} (nothing left to do)"]
        if not self.rl:
            loss = self._change("loss")
            return ["; ".join([head] + ([f"loss {loss}"] if loss else []) + self._parity())]
        parts = [head]
        reward = self._change("reward_mean")
        if reward:
            by_token = [f"{name} {change}" for name in ("high", "low")
                        if (change := self._change(f"reward_mean_{name}"))]
            parts.append(f"rollout reward {reward}" + (f" ({', '.join(by_token)})" if by_token else ""))
        zero_var = self._values("zero_var_frac")
        if zero_var:
            parts.append(f"zero-variance groups {100 * sum(zero_var) / len(zero_var):.0f}% on average")
        skipped = self._values("update_skipped")
        updated = sum(1 for v in skipped if v == 0)
        if skipped:
            parts.append(f"{updated} of {len(skipped)} steps updated the weights")
        out = ["; ".join(parts + self._parity())]
        if not any(map(_informative, self.records)):
            out.append(f"[{self.stage}] WARNING: learned nothing from its rewards: in every step every group's "
                       "rollouts had equal rewards (no advantage, so no gradient from them); more rollouts per "
                       "group, a higher temperature or easier prompts give the groups variance")
        elif skipped and len(skipped) == n and updated == 0:
            out.append(f"[{self.stage}] WARNING: learned nothing: no step changed the weights (every update "
                       "was skipped: no loss token carried a gradient)")
        return out
