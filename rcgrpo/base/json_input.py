"""JSON that a user, a file or an earlier run hands us, parsed so that any
text at all gives a value or a ValueError.

`json.loads` raises RecursionError, not a ValueError, on nesting past the
interpreter's recursion limit (a 100,000-deep line takes 200 kB): bad input
like any other, which every reader here reports in one line (or as one bad
row) instead of dying with a traceback. `read_file` does the same for a whole
file, whose bytes may not be UTF-8 at all.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None


def read_text(path: str | os.PathLike) -> str:
    """A file the user handed us as text; ValueError naming the file and the
    first bad byte when it is not UTF-8 (OSError when it cannot be read)."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def read_file(path: str | os.PathLike, expect: type | None = None) -> Any:
    """The JSON value in `path`; ValueError naming the file for text that is
    not UTF-8, not JSON, nested too deeply, or (with `expect`) not of that type."""
    text = read_text(path)
    try:
        value = loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if expect is not None and not isinstance(value, expect):
        raise ValueError(f"{path} holds a JSON {_json_name(type(value))}, not a JSON {_json_name(expect)}")
    return value


def _json_name(tp: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        tp, tp.__name__)
