"""The command line of `rcgrpo-train` (`python -m rcgrpo.train`) and
`python -m rcgrpo.config`: argv -> a validated Config, the help, and the
lines a run starts with.

Flags follow rcgrpo/base/command_line.py: dotted keys (``--grpo.lr 1e-6``,
``--grpo.lr=1e-6``, ``--model.lora.r 8``; bools also bare: ``--run.fused`` /
``--no-run.fused``) plus the shortcuts in ALIASES. Layers, later wins:
defaults <- preset <- ``--config FILE.toml`` <- flags. The preset is
DEFAULT_PRESET unless ``--preset`` (or the file's ``preset = ...``) names
another or none: naming a model never changes it, so a new model never
silently changes the size of a run; the run's first lines say what applies.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from typing import Optional, Sequence

from rcgrpo.base.command_line import (
    CommandLineError,
    Section,
    deprecated,
    format_help,
    read_flags,
    split_argv,
    type_name,
)
from rcgrpo.config.io import (
    FOLDED,
    KEYS,
    apply_folded,
    apply_settings,
    config_to_toml,
    load_toml,
    set_setting,
    unknown_setting,
)
from rcgrpo.config.presets import DEFAULT_PRESET, PRESET_PURPOSE, PRESETS
from rcgrpo.config.schema import Config, ConfigError, flat_values, leaves
from rcgrpo.config.validation import finalize

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
    "report-to": "run.report_to",
    # TRL's words for the environment (rcgrpo.envs.tool_env)
    "env": "env.name",
    "dataset": "env.dataset",
    "eval-dataset": "env.eval_dataset",
    "tools": "env.tools",
    "reward-funcs": "env.reward_funcs",
}
# The command's own flags (not settings): their metavar and what they do.
COMMAND_FLAGS = {
    "preset": "NAME",
    "config": "FILE.toml",
    "print-config": "",
}
PROG = "rcgrpo-train"


@dataclasses.dataclass
class Resolved:
    """A command line's Config, and where its values came from."""

    cfg: Config
    # dotted key -> "preset NAME", the config file's path, "flag" or
    # "derived" (filled in from others); a key absent has its default.
    origins: dict[str, str]
    # How the preset was chosen: "default", "--preset", or the file naming it.
    preset_by: str


def _command_values(flags) -> tuple[Optional[str], Optional[str]]:
    """The --preset and --config values (each at most once)."""
    found = {}
    for name in ("preset", "config"):
        vals = [text for key, text, _ in flags if key == name]
        if any(v is None for v in vals):
            raise ConfigError(f"--{name} needs a value")
        if len(vals) > 1:
            raise ConfigError(f"--{name} given {len(vals)} times")
        found[name] = vals[0] if vals else None
    return found["preset"], found["config"]


def resolve(argv: Sequence[str], *, check_files: bool = True, prog: str = "rcgrpo.train") -> Resolved:
    """The validated Config of `argv` (no --help here) and its values' origins."""
    try:
        flags = [f for f in split_argv(argv) if f.key != "print-config"]
    except CommandLineError as e:
        raise ConfigError(str(e)) from None
    preset, path = _command_values(flags)
    cfg, origins = Config(), {}
    file_data = load_toml(path) if path else {}
    # A preset named in the file applies first too; the CLI preset wins.
    file_preset = file_data.pop("preset", None)
    chosen = preset if preset is not None else file_preset if file_preset is not None else DEFAULT_PRESET
    preset_by = "--preset" if preset is not None else path if file_preset is not None else "default"
    if chosen != "none":
        if chosen not in PRESETS:
            where = "--preset" if preset is not None else f"in {path}"
            raise ConfigError(f"unknown preset {chosen!r} ({where}); the presets are {', '.join(PRESETS)} "
                              "(none = no preset)")
        apply_settings(cfg, PRESETS[chosen], f"preset {chosen}")
        cfg.preset = chosen
        origins.update({k: f"preset {chosen}" for k in PRESETS[chosen]})
    if path:
        before = flat_values(cfg)
        apply_settings(cfg, file_data, f"in {path}")
        origins.update({k: path for k, v in flat_values(cfg).items() if v != before[k]})

    settings = [f for f in flags if f.key not in ("preset", "config")]
    folded = {k: tp for k, (_, tp, _) in FOLDED.items()}
    try:
        given = read_flags(prog, settings, {**{k: tp for k, (tp, _) in KEYS.items()}, **folded}, ALIASES,
                           unknown=lambda key, flag: unknown_setting(key, list(KEYS) + list(ALIASES), f"flag {flag}"))
    except CommandLineError as e:
        raise ConfigError(str(e)) from None
    for key, value, flag in given:
        if key in FOLDED:
            deprecated(prog, flag, "--" + apply_folded(cfg, key, value, f"flag {flag}"))
            origins[FOLDED[key][0]] = "flag"
            continue
        set_setting(cfg, key, value, f"flag {flag}")
        origins[key] = "flag"
    before = flat_values(cfg)
    finalize(cfg, check_files=check_files)
    origins.update({k: "derived" for k, v in flat_values(cfg).items() if v != before[k] and k not in origins})
    return Resolved(cfg, origins, preset_by)


def _shown(value) -> str:
    """A value as a flag writes it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "[]"
    return str(value)


def usage(argv: Sequence[str] = ()) -> str:
    """The help: every setting grouped by section, with the value `argv` (a
    bare run's by default) resolves it to and where that value came from."""
    note = ""
    try:
        resolved = resolve(argv, check_files=False)
    except ConfigError as e:
        resolved = resolve([], check_files=False)
        note = f"(the other flags do not resolve: {' '.join(str(e).split())}; shown: a bare run's values) "
    preset = resolved.cfg.preset or "none"
    given = "with these flags" if argv else "of a bare run"
    head = [
        f"usage: {PROG} [--preset NAME] [--config FILE.toml] [--section.key VALUE ...]",
        "       (the same: python -m rcgrpo.train, torchrun ... -m rcgrpo.train)",
        "",
        "Trains a pipeline of stages (the default rctp+rc-grpo: rctp-data -> rctp -> rc-grpo -> eval) into "
        "runs/<name>/: each stage's model, metrics, checkpoints, the evaluation table and plots.",
        "",
        f"{note}Each setting below shows the value {given} and, in brackets, what set it when not its default. "
        f"Without --preset the preset {DEFAULT_PRESET} applies, whatever --model names "
        f"({PRESET_PURPOSE[DEFAULT_PRESET]}); "
        "--preset none runs the defaults, the paper's numbers. Layers, later wins: defaults <- --preset <- "
        "--config FILE.toml <- flags.",
        "",
        "A setting is --section.key VALUE or --section.key=VALUE; a bool also --section.key / "
        "--no-section.key; a list is comma-separated; none unsets a setting that accepts none. "
        "Errors are one line (exit code 2).",
        "",
        "Print the resolved configuration as TOML (a file --config reads back) without running: "
        "python -m rcgrpo.config [flags], or --print-config here.",
    ]
    presets = "; ".join(f"{name}: {purpose}" for name, purpose in PRESET_PURPOSE.items())
    command = Section("command", "", [
        (f"--preset {COMMAND_FLAGS['preset']}", f"= {preset}",
         f"{presets}; none: no preset (default: {DEFAULT_PRESET})"),
        (f"--config {COMMAND_FLAGS['config']}", "",
         "settings from a TOML file, [sections] as below; a line preset = \"NAME\" picks its preset"),
        ("--print-config", "", "print the resolved configuration as TOML and exit (as hydra's --cfg job)"),
        ("--debug", "", "show tracebacks (also RCGRPO_DEBUG=1)"),
        ("-h, --help", "", "this help; after other flags, the values they give"),
    ])
    shortcuts = Section("shortcuts", ", ".join(f"--{a} = --{k}" for a, k in ALIASES.items()), [])
    return format_help(head, [command, shortcuts, *_setting_sections(resolved)])


def _setting_sections(resolved: Resolved) -> list[Section]:
    """The help's sections of settings: each setting with its value and,
    when a preset set it, the value without one."""
    cfg, origins = resolved.cfg, resolved.origins
    defaults = flat_values(Config())
    sections: dict[str, Section] = {}
    for key, f, tp, value in leaves(cfg):
        if key == "preset":
            continue
        section = key.rsplit(".", 1)[0]
        if section not in sections:
            obj = cfg
            for part in section.split("."):
                obj = getattr(obj, part)
            about = " ".join((inspect.getdoc(type(obj)) or "").split("\n\n")[0].split())
            sections[section] = Section(section, about, [])
        origin = origins.get(key)
        where = f"  [{origin}; --preset none: {_shown(defaults[key])}]" if origin and origin.startswith("preset") \
            else f"  [{origin}]" if origin else ""
        metavar = type_name(tp).upper().replace(" ", "_")
        sections[section].rows.append((f"--{key} {metavar}", f"= {_shown(value)}{where}", f.metadata.get("help", "")))
    return list(sections.values())


def _size(cfg: Config) -> str:
    """What the run will do, stage by stage, in numbers."""
    d, parts = cfg.data, []
    bfcl = cfg.env.name == "bfcl"
    if not bfcl:
        where = cfg.env.dataset or f"the {cfg.env.name} environment's train split"
        subset = f"{d.train_subset} (a seeded subset) of " if d.train_subset is not None else ""
        parts.append(f"environment {cfg.env.name}: {subset}the training tasks of {where} (data.entry_ids, "
                     "data.categories are BFCL's, not used)")
    elif d.entry_ids is not None:
        parts.append(f"training entries {','.join(d.entry_ids)} (data.entry_ids)")
    elif d.train_subset is not None:
        parts.append(f"{d.train_subset} training entries of {','.join(d.categories)} (a seeded subset)")
    else:
        parts.append(f"every training entry of {','.join(d.categories)} (720 for all four categories)")
    for stage in cfg.stages:
        if stage in ("rctp", "sft"):
            s = getattr(cfg, stage)
            parts.append(f"{stage} {s.epochs} epochs x batch {s.batch_size}, lr {s.lr:g}")
        elif stage in ("grpo", "rc-grpo"):
            g = cfg.grpo
            parts.append(f"{stage} {g.steps} steps x {g.batch_size} prompts x {g.group_size} rollouts, lr {g.lr:g}")
        elif stage == "eval":
            e = cfg.eval
            count = (f"{e.subset} {e.split} {'entry' if e.subset == 1 else 'entries'} per category"
                     if e.subset is not None else f"every {e.split} entry")
            parts.append(f"eval {count} of {','.join(e.categories)}" if bfcl else
                         f"eval {e.subset if e.subset is not None else 'every'} task(s) per category of "
                         f"{cfg.env.eval_dataset or 'the environment test split'}")
    return "; ".join(parts)


def run_header(resolved: Resolved, argv: Sequence[str] = ()) -> list[str]:
    """The lines a run starts with: the preset and why, the model, the
    stages, the run's size, where the values came from."""
    cfg, origins = resolved.cfg, resolved.origins
    model_named = "model.name_or_path" in origins and origins["model.name_or_path"] != f"preset {cfg.preset}"
    if cfg.preset is None:
        preset = "no preset (--preset none): the defaults, the paper's numbers"
    elif resolved.preset_by == "default":
        whatever = ", whatever --model names" if model_named else ""
        preset = (f"preset {cfg.preset} (the default{whatever}: {PRESET_PURPOSE.get(cfg.preset, '')}; "
                  "--preset none runs the paper's sizes)")
    else:
        by = "--preset" if resolved.preset_by == "--preset" else f"from {resolved.preset_by}"
        preset = f"preset {cfg.preset} ({by}: {PRESET_PURPOSE.get(cfg.preset, 'see config_presets.toml')})"
    counts: dict[str, int] = {}
    for origin in origins.values():
        counts[origin] = counts.get(origin, 0) + 1
    named = {"flag": "flags"}
    sources = ", ".join(f"{n} from {named.get(o, o)}" for o, n in counts.items() if o != "derived")
    flags = " ".join(argv)
    return [
        preset,
        f"model {cfg.model.name_or_path}; pipeline {cfg.run.pipeline}: {' -> '.join(cfg.stages)}; "
        f"run folder {cfg.run_dir}",
        f"size: {_size(cfg)}",
        f"settings not at their default: {sources or 'none'}; all of them: python -m rcgrpo.config {flags}".rstrip(),
    ]


def parse_command_line(argv: Optional[Sequence[str]] = None, *, check_files: bool = True,
                       prog: str = "rcgrpo.train") -> Resolved:
    """`resolve`, after the flags that answer and exit: ``--help`` prints
    every setting, ``--print-config`` the resolved TOML (SystemExit 0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(usage([a for a in argv if a not in ("-h", "--help")]), end="")
        raise SystemExit(0)
    resolved = resolve(argv, check_files=check_files, prog=prog)
    if "--print-config" in argv:
        print(config_to_toml(resolved.cfg), end="")
        raise SystemExit(0)
    return resolved


def parse_args(argv: Optional[Sequence[str]] = None, *, check_files: bool = True) -> Config:
    """Build the validated Config from defaults, preset, TOML file and flags.

    ``--help`` prints every setting and exits (SystemExit 0). Any problem
    raises ConfigError before anything heavy happens. ``check_files=False``
    skips the existence checks (for tests and tools that only inspect).
    """
    return parse_command_line(argv, check_files=check_files).cfg


def load_config(path: str | os.PathLike, *, check_files: bool = True) -> Config:
    """A saved config.toml (e.g. a run's) as a validated Config."""
    return parse_args(["--config", str(path)], check_files=check_files)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m rcgrpo.config [flags]`: the resolved configuration as TOML."""
    try:
        cfg = parse_command_line(argv, prog="rcgrpo.config").cfg
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(config_to_toml(cfg), end="")
    return 0


__all__ = ["ALIASES", "DEFAULT_PRESET", "Resolved", "resolve", "usage", "run_header",
           "parse_command_line", "parse_args", "load_config", "main"]
