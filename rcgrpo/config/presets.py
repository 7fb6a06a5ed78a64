"""The presets: named sets of settings applied before a --config file and
the flags (``--preset NAME``). Their values are data, in
rcgrpo/config/presets.toml; here they are read, and said what each is for
and which applies when none is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser under its PyPI name
    import tomli as tomllib  # type: ignore[no-redef]


def _flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """Nested tables -> {dotted key: value}."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


# Preset name -> {dotted key: value}: settings applied before a config file
# and the flags.
_PRESETS_TOML = Path(__file__).with_name("presets.toml").read_text(encoding="utf-8")
PRESETS: dict[str, dict[str, Any]] = {name: _flatten(t) for name, t in tomllib.loads(_PRESETS_TOML).items()}

# The embedded 135M model on a CPU is the default: a bare run is the run
# sized for this machine, whatever model it names (`--preset none` gives the
# schema's defaults, the paper's numbers; `--preset paper-qwen7b` the paper's
# 7B setting).
DEFAULT_PRESET = "cpu-small"
# What each preset is for, in the help and the run's first lines.
PRESET_PURPOSE = {
    "cpu-small": "a run sized for a 2-core CPU: 2 training entries, 3 RL steps",
    "paper-qwen7b": "the paper's Qwen2.5-7B setting on GPUs, at the paper's sizes",
}
