"""The leakage-free 720/80 train/test split.

Entries with the same numeric id in different categories are variants of the
same scenario (long_context and base share 195 of 200 first turns), so the
split is made over numeric ids: 20 ids are held out, and all four entries of a
held-out id go to the test side. The held-out ids are a pure function of the
ids present in the data and a fixed seed (tests/envs/test_split.py holds that
function); `test_split.json` records them, so a change in either shows up as a
failing test rather than a silent leak.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from rcgrpo.envs.data import BFCLEntry

NUM_TEST_IDS = 20
RECORDED_SPLIT = Path(__file__).with_name("test_split.json")


def recorded_test_ids() -> list[int]:
    return json.loads(RECORDED_SPLIT.read_text())["test_ids"]


def split_train_test(entries: Sequence[BFCLEntry]) -> tuple[list[BFCLEntry], list[BFCLEntry]]:
    """(train, test) in input order; test = every entry whose id is held out."""
    test_ids = set(recorded_test_ids())
    train = [e for e in entries if e.index not in test_ids]
    test = [e for e in entries if e.index in test_ids]
    return train, test
