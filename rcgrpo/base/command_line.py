"""The command-line convention of every rcgrpo command (rcgrpo-train,
rcgrpo-eval, rcgrpo-report): how argv is read and how the help is laid out.

* A setting is its dotted key: ``--section.key VALUE`` or
  ``--section.key=VALUE``; a bool is also bare (``--run.fused``) or negated
  (``--no-run.fused``); a list is comma-separated; ``none`` unsets a setting
  that accepts none. The keys are those of a run's config.toml.
* A few shortcut words stand for the commonest keys (``--model``, ``--name``).
* An old spelling keeps working and says so in one line on stderr.
* No positional arguments: every value is named.

This module imports nothing heavy (rcgrpo-report and `rcgrpo-eval --replay`
read their flags without loading torch); each command owns its keys.
"""
from __future__ import annotations

import difflib
import shutil
import sys
import textwrap
import types
import typing
from typing import Callable, Iterable, Mapping, Optional, Sequence

from rcgrpo.base.errors import UserError

__all__ = ["CommandLineError", "Flag", "split_argv", "from_text", "deprecated", "read_flags", "Section",
           "format_help", "terminal_width"]

# The words a bool flag's value may be.
BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class CommandLineError(UserError, ValueError):
    """A flag that cannot be read (no value, a wrong type, a positional argument)."""


class Flag(typing.NamedTuple):
    key: str  # as written, without the dashes (aliases not yet resolved)
    text: Optional[str]  # the value's text; None for a bare flag
    spelled: str  # the argument as given, for messages


def split_argv(argv: Sequence[str]) -> list[Flag]:
    """argv -> flags, in order: ``--key value``, ``--key=value``, bare ``--key``."""
    out, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--") or arg == "--":
            raise CommandLineError(f"unexpected argument {arg!r}: settings are given as --key value")
        key, given, value = arg[2:].partition("=")
        if not given:  # `--key value`, or a bare `--key`
            value = rest.pop(0) if rest and not rest[0].startswith("--") else None
        out.append(Flag(key, value, arg))
    return out


def optional_inner(tp):
    """X for Optional[X], else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return None


def type_name(tp) -> str:
    inner = optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} or none"
    if typing.get_origin(tp) is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def from_text(text: str, tp, key: str):
    """A flag's text converted to the type `tp` of the setting `key`."""
    inner = optional_inner(tp)
    if inner is not None:
        # Only the word spells none: an empty value ("--name ''", an unset
        # shell variable) is refused by validation, never read as the default.
        return None if text.strip().lower() in ("none", "null") else from_text(text, inner, key)
    if typing.get_origin(tp) is list:
        if not text.strip():
            return []  # refused by validation for a list that must not be empty
        # Empty items ("a,,b") are kept, so that validation refuses them.
        return [from_text(p.strip(), typing.get_args(tp)[0], key) for p in text.split(",")]
    if tp is str:
        return text
    if tp is bool and text.strip().lower() in BOOLS:
        return BOOLS[text.strip().lower()]
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            pass
    raise CommandLineError(f"{key}: expected {type_name(tp)}, got {text!r}")


def deprecated(prog: str, old: str, new: str) -> None:
    """The one line an old spelling prints: it still works, and says what replaces it."""
    print(f"{prog}: deprecated: {old} still works, but write {new}", file=sys.stderr, flush=True)


def read_flags(prog: str, flags: Iterable[Flag], known: Mapping[str, object],
               aliases: Optional[Mapping[str, str]] = None, old: Optional[Mapping[str, str]] = None,
               unknown: Optional[Callable[[str, str], Exception]] = None) -> list[tuple[str, object, str]]:
    """Flags -> [(key, value of the key's type, flag as given)], in order.

    `known`: each key this command takes -> its type; `aliases`: shortcut
    word -> key; `old`: deprecated spelling -> key (one deprecation line
    each); `unknown(key, flag)`: the error for any other key.
    """
    aliases, old, out = aliases or {}, old or {}, []
    for key, text, spelled in flags:
        negated = key.startswith("no-") and text is None
        if negated:
            key = key[3:]
        if key in old:
            no = "no-" if negated else ""
            deprecated(prog, f"--{no}{key}", f"--{no}{old[key]}")
            key = old[key]
        key = aliases.get(key, key)
        if key not in known:
            raise unknown(key, spelled) if unknown else _unknown_flag(key, spelled, [*known, *aliases, *old])
        tp = known[key]
        if text is None:
            if tp is not bool:
                raise CommandLineError(f"{spelled} needs a value ({type_name(tp)})")
            text = "false" if negated else "true"
        out.append((key, from_text(text, tp, key), spelled))
    return out


def _unknown_flag(key: str, spelled: str, names: Sequence[str]) -> CommandLineError:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0]}?" if close else ""
    return CommandLineError(f"unknown flag {spelled.split('=', 1)[0]}{hint} (see --help)")


# ----------------------------------------------------------------- the help


def terminal_width() -> int:
    """The terminal's columns (COLUMNS wins; 100 off a terminal), kept readable."""
    return max(60, min(shutil.get_terminal_size((100, 24)).columns, 140))


class Section(typing.NamedTuple):
    title: str  # "grpo", "what to evaluate"
    about: str  # one sentence under the title, or ""
    rows: Sequence[tuple[str, str, str]]  # (flag with its metavar, value or default, help)


def format_help(head: Sequence[str], sections: Sequence[Section], width: Optional[int] = None) -> str:
    """The help: `head` paragraphs, then each section's rows, wrapped to
    `width` (the terminal's by default). A row is its flag and value on one
    line, its help indented below."""
    width = width or terminal_width()
    wrap = lambda text, indent: textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent,
                                              break_on_hyphens=False, break_long_words=False)
    lines = []
    for para in head:
        # Usage lines and those starting with spaces are kept as written.
        lines.extend([para] if para.startswith((" ", "usage:")) or not para else [wrap(para, "")])
    for section in sections:
        lines += ["", section.title + ":"]
        if section.about:
            lines.append(wrap(section.about, "  "))
        for flag, value, help in section.rows:
            lines.append(wrap(f"{flag}  {value}".rstrip() if value else flag, "  "))
            if help:
                lines.append(wrap(help, "      "))
    return "\n".join(lines) + "\n"
