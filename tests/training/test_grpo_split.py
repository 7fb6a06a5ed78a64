"""rcgrpo.training.grpo, split in the layout renovation (issue 26), still
imports for one release: its old names, each the very object at its new
home, with a DeprecationWarning naming the new modules (rcgrpo/moved.py)."""
import importlib
import sys

import pytest

from rcgrpo.moved import SPLIT


def test_the_split_grpo_module_keeps_its_old_names_with_a_warning(monkeypatch):
    monkeypatch.delitem(sys.modules, "rcgrpo.training.grpo", raising=False)
    with pytest.warns(DeprecationWarning, match=r"rcgrpo\.training\.grpo was split into .*rcgrpo\.training\.rl_loop"):
        grpo = importlib.import_module("rcgrpo.training.grpo")
    homes = SPLIT["rcgrpo.training.grpo"]
    assert {"train_rl", "accumulate_gradients", "Agreement", "dynamic_sampling", "probe_seed"} <= set(homes)
    for name, home in homes.items():
        assert getattr(grpo, name) is getattr(importlib.import_module(home), name), name
    # Its signature changed (rl_update(..., optimizer=, scheduler=) now): not offered under the old name.
    assert not hasattr(grpo, "rl_step")
