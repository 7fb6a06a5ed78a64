"""Settings in and out of a Config by dotted key: one value set with its type
checked, a nested table of them applied (a TOML file, a saved config.json, a
preset), a TOML file read, a Config written as TOML, saved into its run
folder, or made from a saved dict.

A wrong key or value raises ConfigError naming the key and where it came
from; for an unknown key, the likeliest one meant (SYNONYMS: the paper's
symbols and other trainers' names for our settings).
"""

from __future__ import annotations

import difflib
import json
import os
import typing
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import rcgrpo_kernels
from rcgrpo.base import json_input
from rcgrpo.base.atomic import atomic_write_text
from rcgrpo.base.command_line import deprecated, optional_inner, type_name
from rcgrpo.config.schema import Config, ConfigError, all_keys
from rcgrpo.config.validation import finalize
from rcgrpo.run.folder import RunFolder

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser under its PyPI name
    import tomli as tomllib  # type: ignore[no-redef]

SYNONYMS = {
    "g": "group_size", "num_generations": "group_size", "n_samples": "group_size",
    "kl_coef": "beta", "kl_beta": "beta", "eps": "eps_low", "epsilon": "eps_low", "clip_eps": "eps_low",
    "p": "p_high", "learning_rate": "lr", "bs": "batch_size", "epoch": "epochs",
}
# Settings taken out of the schema -> why. The saved configs of earlier runs
# still hold them: reading a file or table skips them, so that such a run can
# be resumed and its models evaluated; a flag naming one is told why.
RETIRED = {"run.log_every": "metric lines are written every step",
           "run.grad_accum": "a step accumulates the micro-batches its batch needs (run.micro_batch_tokens sizes them)"}


def _advantage_estimator_name(value: Any) -> Any:
    """advantage_scale's "group" / "none" are the estimators grpo / dr_grpo."""
    try:
        return rcgrpo_kernels.get_advantage_estimator(value).name
    except ValueError:
        return value  # the setting's own check refuses it, in one line


# Settings given a new name -> (that name, the old value read as a new one).
# Saved configs of earlier runs hold the old name: reading them maps it, so
# that such a run can be resumed; a flag naming it is told the new name.
RENAMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "grpo.advantage_scale": ("grpo.advantage_estimator", _advantage_estimator_name),
}


def _tensorboard_into_report_to(cfg: Config, on: Any) -> None:
    """run.tensorboard true / false: tensorboard in / out of run.report_to."""
    trackers = [t for t in cfg.run.report_to or [] if t != "tensorboard"] + (["tensorboard"] if on else [])
    cfg.run.report_to = trackers or None


# Settings folded into another, which a value of theirs changes -> (that
# setting, its type here, how the value changes the config). A flag or a
# file (a saved config of an earlier run too) may still name them: the value
# is applied, with one deprecation line.
FOLDED: dict[str, tuple[str, type, Callable[[Config, Any], None]]] = {
    "run.tensorboard": ("run.report_to", bool, _tensorboard_into_report_to),
}


def apply_folded(cfg: Config, key: str, value: Any, where: str) -> str:
    """Apply the folded setting `key` (see FOLDED); returns what replaces it,
    "run.report_to none", for the deprecation line."""
    new, tp, fold = FOLDED[key]
    fold(cfg, checked(value, tp, key, where))
    now = cfg
    for part in new.split("."):
        now = getattr(now, part)
    return f"{new} {'none' if now is None else ','.join(now) if isinstance(now, list) else now}"


# Every dotted key -> (type, help). The schema is fixed, so it is walked once.
KEYS = all_keys()
# Every section ("grpo", "model.lora"): a proper dotted prefix of some key.
SECTIONS = frozenset(key.rsplit(".", i)[0] for key in KEYS for i in range(1, key.count(".") + 1))


def unknown_setting(key: str, known: Sequence[str], where: str) -> ConfigError:
    """The error for a key that is not a setting, naming the likeliest one meant."""
    if key in RETIRED:
        return ConfigError(f"{key!r} ({where}) is no longer a setting: {RETIRED[key]}")
    if key in RENAMED:
        return ConfigError(f"{key!r} ({where}) is now called {RENAMED[key][0]!r}")
    head, _, last = key.rpartition(".")
    syn = SYNONYMS.get(last.lower())
    if syn:
        candidate = f"{head}.{syn}" if head else syn
        if candidate in known:
            return ConfigError(f"unknown setting {key!r} ({where}); did you mean {candidate!r}?")
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    # A bare field name ("lr") is most likely meant inside some section.
    if not close:
        close = [k for k in known if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]][:3]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(f"unknown setting {key!r} ({where}){hint}")


def checked(value, tp, key: str, where: str):
    """A TOML/dict value checked (and int->float widened) against the field type."""
    inner = optional_inner(tp)
    if inner is not None:
        # TOML has no null: the string "none" spells it (what to_toml writes).
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        return checked(value, inner, key, where)
    if typing.get_origin(tp) is list and isinstance(value, (list, tuple)):
        return [checked(v, typing.get_args(tp)[0], key, where) for v in value]
    if isinstance(value, bool) and tp is not bool:
        pass  # a bool is an int to isinstance, but never a number here
    elif tp is float and isinstance(value, (int, float)):
        return float(value)
    elif tp in (bool, int, str) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key} ({where}): expected {type_name(tp)}, got {type(value).__name__} {value!r}")


def set_setting(cfg: Config, key: str, value: Any, where: str,
                convert: Optional[Callable[[Any, Any, str], Any]] = None) -> None:
    """Set the dotted `key` to `value` checked against its type, or to
    `convert(value, type, key)` (the command line converts its text)."""
    if key not in KEYS:
        raise unknown_setting(key, KEYS, where)
    tp = KEYS[key][0]
    value = convert(value, tp, key) if convert else checked(value, tp, key, where)
    *path, last = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, last, value)


def apply_settings(cfg: Config, table: dict, where: str, prefix: str = "") -> None:
    """Set every setting of a nested (or dotted-key) table in `cfg`."""
    for k, v in table.items():
        key = prefix + str(k)
        if key in RETIRED:
            continue
        if key in FOLDED:
            deprecated("rcgrpo.config", f"{key} ({where})", apply_folded(cfg, key, v, where))
            continue
        if key in RENAMED:
            key, rename = RENAMED[key]
            v = rename(v)
        if isinstance(v, dict):
            if key not in SECTIONS:
                raise unknown_setting(key, [x.rsplit(".", 1)[0] for x in KEYS] + list(KEYS), where)
            apply_settings(cfg, v, where, key + ".")
        elif key in SECTIONS:
            raise ConfigError(f"{key!r} is a section ({where}): write [{key}] with its settings, "
                              f"not {key} = {v!r}")
        else:
            set_setting(cfg, key, v, where)


def load_toml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        text = json_input.read_text(p)  # names the first byte that is not UTF-8
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
    except RecursionError:  # tomllib recurses on nested arrays and inline tables
        raise ConfigError(f"config file {p} is not valid TOML: nested too deeply to read") from None
    except ValueError as e:
        raise ConfigError(f"config file {e}") from None


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are valid TOML basic strings
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(d: dict) -> str:
    """Minimal TOML writer for this config's shapes (the stdlib only reads
    TOML). None has no TOML form: it is written as the string "none", which
    `checked` maps back to None for the settings that accept none."""
    lines: list[str] = []

    def table(prefix: str, t: dict) -> None:
        if prefix:
            lines.append(f"\n[{prefix}]")
        scalars = {k: "none" if v is None else v for k, v in t.items() if not isinstance(v, dict)}
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in scalars.items())
        for k, v in t.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}" if prefix else k, v)

    table("", d)
    return "\n".join(lines).lstrip("\n") + "\n"


def config_to_toml(cfg: Config) -> str:
    """`cfg` as a TOML file that --config reads back."""
    return to_toml(cfg.to_dict())


def save_config(cfg: Config, run_dir: str | os.PathLike | None = None) -> Path:
    """Write config.toml and config.json into `run_dir` (default: the run's
    folder), atomically; returns the path of config.toml."""
    folder = RunFolder(run_dir if run_dir is not None else cfg.run_dir)
    folder.path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder.config_toml, config_to_toml(cfg))
    atomic_write_text(folder.config_json, json.dumps(cfg.to_dict(), indent=2) + "\n")
    return folder.config_toml


def config_from_dict(d: dict, source: str = "dict", check_files: bool = True) -> Config:
    """Defaults overlaid with `d` (nested sections, e.g. a checkpoint's
    run_config.json), then validated; `source` names `d` in the errors."""
    cfg = Config()
    apply_settings(cfg, d, f"in {source}")
    return finalize(cfg, check_files=check_files)
