"""Old import paths of modules the layout renovation moved (issue 26): each
still imports, for one release, as the very module at its new path (not a
copy, so a monkeypatch through either name is seen through the other), with
a DeprecationWarning naming the new path.

Installed by ``rcgrpo/__init__.py``; nothing else of rcgrpo imports it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
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


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import <old path>`` -> the module at its new path, with one warning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in rcgrpo 0.2", DeprecationWarning,
                      stacklevel=2)
        module = importlib.import_module(new)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the old path's spec on the module; give it its own back.
        module.__spec__ = self._own_spec


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
