"""The command line of `python -m rcgrpo.train` (and `python -m rcgrpo.config`):
argv -> a validated Config.

Flags are dotted keys (``--grpo.lr 1e-6``, ``--grpo.lr=1e-6``,
``--model.lora.r 8``; bools also bare: ``--run.fused`` / ``--no-run.fused``)
plus the shortcuts in ALIASES. Layers, later wins: defaults <- preset <-
``--config FILE.toml`` <- flags.
"""

from __future__ import annotations

import os
import sys
import typing
from typing import Optional, Sequence

from rcgrpo.config import PRESETS, Config, ConfigError, finalize, flat_values
from rcgrpo.config_io import KEYS, apply_settings, load_toml, optional_inner, set_setting, type_name, unknown_setting

# Shortcut flags -> dotted keys.
ALIASES = {
    "fused": "run.fused",
    "pipeline": "run.pipeline",
    "stages": "run.stages",
    "resume": "run.resume",
    "name": "run.name",
    "model": "model.name_or_path",
    "out-dir": "run.out_dir",
    "device": "run.device",
}
# The embedded 135M model is the CPU default: `python -m rcgrpo.train --fused`
# alone runs the run sized for this machine (`--preset none` gives the
# paper-sized defaults instead).
DEFAULT_PRESET = "cpu-small"
# The words a bool flag's value may be.
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _from_text(text: str, tp, key: str):
    """A CLI string converted to the field's type."""
    inner = optional_inner(tp)
    if inner is not None:
        # Only the word spells none: an empty value ("--name ''", an unset
        # shell variable) is refused by validation, never read as the default.
        return None if text.strip().lower() in ("none", "null") else _from_text(text, inner, key)
    if typing.get_origin(tp) is list:
        if not text.strip():
            return []  # refused by validation for a list that must not be empty
        # Empty items ("a,,b") are kept, so that validation refuses them.
        return [_from_text(p.strip(), typing.get_args(tp)[0], key) for p in text.split(",")]
    if tp is str:
        return text
    if tp is bool and text.strip().lower() in _BOOLS:
        return _BOOLS[text.strip().lower()]
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {text!r}")


def _split_argv(argv: Sequence[str]) -> list[tuple[str, Optional[str], str]]:
    """argv -> [(key, text value or None for a bare flag, original flag)]."""
    out, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: settings are given as --key value")
        key, given, value = arg[2:].partition("=")
        if not given:  # `--key value`, or a bare `--key`
            value = rest.pop(0) if rest and not rest[0].startswith("--") else None
        out.append((key, value, arg))
    return out


def usage() -> str:
    lines = [
        "usage: python -m rcgrpo.train [--config FILE.toml] [--preset NAME] [--key value ...]",
        "",
        "shortcuts: " + ", ".join(f"--{a} (= --{k})" for a, k in ALIASES.items()),
        f"presets: {', '.join(PRESETS)}",
        "bools: --key, --key true/false, --no-key",
        "errors are one line (exit code 2); --debug (or RCGRPO_DEBUG=1) shows tracebacks",
        "",
        "settings (defaults):",
    ]
    defaults = flat_values(Config())
    for key, (tp, help) in KEYS.items():
        lines.append(f"  --{key} {type_name(tp).upper().replace(' ', '_')}  [{defaults[key]!r}]  {help}")
    return "\n".join(lines)


def _names_a_model(flags, file_data: dict) -> bool:
    from_flags = any(ALIASES.get(k, k) == "model.name_or_path" for k, _, _ in flags)
    model = file_data.get("model")
    # A non-table `model = ...` is reported by apply_settings, naming the key.
    return from_flags or (isinstance(model, dict) and "name_or_path" in model)


def _apply_preset(cfg: Config, name: str, where: str) -> None:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} ({where}); the presets are {', '.join(PRESETS)} "
                          "(none = no preset)")
    apply_settings(cfg, PRESETS[name], f"preset {name}")
    cfg.preset = name


def parse_args(argv: Optional[Sequence[str]] = None, *, check_files: bool = True) -> Config:
    """Build the validated Config from defaults, preset, TOML file and flags.

    ``--help`` prints every setting and exits (SystemExit 0). Any problem
    raises ConfigError before anything heavy happens. ``check_files=False``
    skips the existence checks (for tests and tools that only inspect).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        raise SystemExit(0)
    flags = _split_argv(argv)
    cfg = Config()
    preset = [v for k, v, _ in flags if k == "preset"]
    files = [v for k, v, _ in flags if k == "config"]
    for name, vals in (("--preset", preset), ("--config", files)):
        if any(v is None for v in vals):
            raise ConfigError(f"{name} needs a value")
        if len(vals) > 1:
            raise ConfigError(f"{name} given {len(vals)} times")
    file_data = load_toml(files[0]) if files else {}
    # A preset named in the file applies first too; the CLI preset wins.
    file_preset = file_data.pop("preset", None)
    chosen = preset[0] if preset else file_preset
    if chosen is None and not _names_a_model(flags, file_data):
        chosen = DEFAULT_PRESET
    if chosen not in (None, "none"):
        _apply_preset(cfg, chosen, "--preset" if preset else files[0] if file_preset else "default preset")
    if files:
        apply_settings(cfg, file_data, f"in {files[0]}")

    for key, value, flag in flags:
        if key in ("preset", "config"):
            continue
        negated = False
        if key.startswith("no-") and value is None:
            key, negated = key[3:], True
        key = ALIASES.get(key, key)
        if key not in KEYS:
            raise unknown_setting(key, list(KEYS) + list(ALIASES), f"flag {flag}")
        tp = KEYS[key][0]
        if value is None:
            if tp is not bool:
                raise ConfigError(f"{flag} needs a value ({type_name(tp)})")
            value = "false" if negated else "true"
        set_setting(cfg, key, value, f"flag {flag}", convert=_from_text)
    return finalize(cfg, check_files=check_files)


def load_config(path: str | os.PathLike, *, check_files: bool = True) -> Config:
    """A saved config.toml (e.g. a run's) as a validated Config."""
    return parse_args(["--config", str(path)], check_files=check_files)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m rcgrpo.config [flags]`: the resolved configuration as TOML."""
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(cfg.to_toml(), end="")
    return 0
