"""JSON that a user, a file or an earlier run hands us, parsed so that any
text at all gives a value or a ValueError.

`json.loads` raises RecursionError, not a ValueError, on nesting past the
interpreter's recursion limit (a 100,000-deep line takes 200 kB): bad input
like any other, which every reader here reports in one line (or as one bad
row) instead of dying with a traceback.
"""
from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
