"""Old import paths of modules the layout renovation moved (issue 26): each
still imports, for one release, as the very module at its new path (not a
copy, so a monkeypatch through either name is seen through the other), with
a DeprecationWarning naming the new path.

A module split into several (SPLIT) imports at its old path as a module of
its old public names, each the very object at its new home, with the same
warning; names whose signature changed in the split are not among them.

Installed by ``rcgrpo/__init__.py``; nothing else of rcgrpo imports it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old dotted path -> new dotted path. Remove after release 0.2.
MOVED: dict[str, str] = {
    "rcgrpo.errors": "rcgrpo.base.errors",
    "rcgrpo.atomic": "rcgrpo.base.atomic",
    "rcgrpo.json_input": "rcgrpo.base.json_input",
    "rcgrpo.distributed": "rcgrpo.base.distributed",
    "rcgrpo.command_line": "rcgrpo.base.command_line",
    "rcgrpo.stages": "rcgrpo.base.stages",
    "rcgrpo.run_lock": "rcgrpo.run.lock",
    "rcgrpo.metrics": "rcgrpo.run.metrics",
    "rcgrpo.trackers": "rcgrpo.run.trackers",
    "rcgrpo.checkpoint": "rcgrpo.run.checkpoint",
    "rcgrpo.reward_tokens": "rcgrpo.conditioning.reward_tokens",
    "rcgrpo.prompts": "rcgrpo.conditioning.prompts",
    "rcgrpo.models": "rcgrpo.model.loading",
    "rcgrpo.lora": "rcgrpo.model.lora",
    "rcgrpo.attention": "rcgrpo.model.attention",
    "rcgrpo.tree_attention": "rcgrpo.model.tree_attention",
    "rcgrpo.prefix_sharing": "rcgrpo.model.prefix_sharing",
    "rcgrpo.batch": "rcgrpo.model.packing",
    "rcgrpo.policy": "rcgrpo.model.policy",
    "rcgrpo.training.sharded_state": "rcgrpo.model.sharded_state",
    "rcgrpo.hub": "rcgrpo.model.hub",
    "rcgrpo.sharing": "rcgrpo.model.sharing",
    "rcgrpo.config_cli": "rcgrpo.config.cli",
    "rcgrpo.config_io": "rcgrpo.config.io",
    "rcgrpo.config_validation": "rcgrpo.config.validation",
    "rcgrpo.data.sources": "rcgrpo.config.schema",
    "rcgrpo.memory": "rcgrpo.training.memory_plan",
    "rcgrpo.report_cli": "rcgrpo.report.cli",
    "rcgrpo.plots": "rcgrpo.report.plots",
    "rcgrpo.resume": "rcgrpo.pipeline.resume",
}


# old dotted path of a module split in several -> {its public name: the module that holds it now}.
# Remove after release 0.2. Not here: rl_step and rl_update (one function now,
# rcgrpo.training.rl_update.rl_update(ctx, policy, trajectories, settings, update,
# optimizer=..., scheduler=..., step=..., parity=...)).
_RL_LOOP, _RL_UPDATE, _STATS = "rcgrpo.training.rl_loop", "rcgrpo.training.rl_update", "rcgrpo.training.rl_statistics"
SPLIT: dict[str, dict[str, str]] = {
    "rcgrpo.training.grpo": {
        "train_rl": _RL_LOOP, "prompt_schedule": _RL_LOOP, "step_share": _RL_LOOP,
        "UpdateSettings": _RL_UPDATE, "to_trajectories": _RL_UPDATE, "prepare_batch": _RL_UPDATE,
        "TOKEN_COUNTS": _RL_UPDATE, "trainer_logprobs": _RL_UPDATE, "accumulate_gradients": _RL_UPDATE,
        "mini_batch_split": _RL_UPDATE,
        "group_stats": _STATS, "RolloutSummary": _STATS, "gather_summaries": _STATS,
        "Agreement": "rcgrpo.training.agreement", "tis_weights": "rcgrpo.training.agreement",
        "informative_groups": "rcgrpo.training.dynamic_sampling", "extra_prompts": "rcgrpo.training.dynamic_sampling",
        "dynamic_sampling": "rcgrpo.training.dynamic_sampling",
        "probe_seed": "rcgrpo.training.reward_probe", "RewardProbe": "rcgrpo.training.reward_probe",
    },
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import <old path>`` -> the module at its new path (or, for a split
    module, a module of its old names), with one warning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED and fullname not in SPLIT:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        if spec.name in SPLIT:
            homes = SPLIT[spec.name]
            warnings.warn(f"{spec.name} was split into {', '.join(sorted(set(homes.values())))}; the old path goes "
                          "in rcgrpo 0.2", DeprecationWarning, stacklevel=2)
            module = types.ModuleType(spec.name, f"Deprecated: the old names of {spec.name} (rcgrpo/moved.py).")
            for name, home in homes.items():
                setattr(module, name, getattr(importlib.import_module(home), name))
            module.__all__ = sorted(homes)
            return module
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in rcgrpo 0.2", DeprecationWarning,
                      stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # kept on the spec, which the import system stamps on the module
        return module

    def exec_module(self, module):
        # The import system stamped the old path's spec on the module; give a moved one its own back.
        if module.__spec__.loader_state is not None:
            module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
