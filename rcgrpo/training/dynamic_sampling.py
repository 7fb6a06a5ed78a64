"""DAPO's dynamic sampling: an RL step keeps only the groups whose rewards
differ, and plays more prompts until it has a batch of them (or runs out of
draws)."""
from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from typing import Sequence

from rcgrpo.model.packing import informative


def informative_groups(rollouts) -> list[list]:
    """The informative groups (rollouts of one prompt, in order; the rule:
    rcgrpo.model.packing.informative): the only ones with a non-zero advantage."""
    by_group: dict[int, list] = defaultdict(list)
    for r in rollouts:
        by_group[r.group].append(r)
    return [rs for _, rs in sorted(by_group.items()) if informative(r.reward for r in rs)]


def extra_prompts(num_entries: int, used: set[int], count: int, rng: random.Random) -> list[int]:
    """`count` entry indices for a dynamic-sampling draw: entries not yet
    played in this step first, in a seeded order; repeats only once every
    entry has been played."""
    fresh = [i for i in range(num_entries) if i not in used]
    rng.shuffle(fresh)
    picked = fresh[:count]
    while len(picked) < count:
        picked.append(rng.randrange(num_entries))
    return picked


def dynamic_sampling(play, first_prompts: Sequence[int], first_rollouts, num_entries: int, batch_size: int,
                     max_draws: int, seed: int) -> tuple[list, dict[str, int]]:
    """DAPO's dynamic sampling: keep the informative groups of the step's
    scheduled prompts, and while fewer than `batch_size` are kept and fewer
    than `max_draws` rounds were played, draw as many new prompts as are
    missing and play them (`play(entry_indices, draw) -> rollouts`).

    Returns the kept rollouts (at most `batch_size` groups, renumbered 0..K-1
    in the order they were kept) and the step's counts."""
    rng = random.Random(seed)
    kept = informative_groups(first_rollouts)
    drawn, draws = len(first_prompts), 1
    used = set(first_prompts)
    while len(kept) < batch_size and draws < max_draws:
        prompts = extra_prompts(num_entries, used, batch_size - len(kept), rng)
        used.update(prompts)
        kept.extend(informative_groups(play(prompts, draws)))
        drawn += len(prompts)
        draws += 1
    kept = kept[:batch_size]
    rollouts = [dataclasses.replace(r, group=g) for g, group in enumerate(kept) for r in group]
    counts = {"ds_draws": draws, "ds_prompts_drawn": drawn, "ds_groups_kept": len(kept),
              "ds_groups_dropped": drawn - len(kept)}
    return rollouts, counts
