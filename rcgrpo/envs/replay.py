"""Score recorded call strings (BFCL result-file structure) through an Episode."""
from __future__ import annotations

from rcgrpo.envs.bfcl import Episode
from rcgrpo.envs.calls import Call, Positional
from rcgrpo.envs.data import BFCLEntry
from rcgrpo.envs.results import EpisodeResult
from rcgrpo.envs.reward import ground_truth


def replay(entry: BFCLEntry, turns: list[list[list[str]]], positional: Positional = "drop") -> EpisodeResult:
    """`turns[t][s]` is the list of call strings of step s of turn t.

    Each call string is decoded as model output (safely); a step with no
    decodable call is skipped, as the official runner skips it. Fewer turns
    than the entry has means the run was cut short (force-terminated).
    """
    if not isinstance(turns, list) or len(turns) > len(entry.turns):
        raise ValueError(
            f"expected a list of at most {len(entry.turns)} turns, got "
            f"{len(turns) if isinstance(turns, list) else type(turns).__name__}"
        )
    episode = Episode(entry, positional=positional)
    for turn in turns:
        if not isinstance(turn, list):
            raise ValueError(f"a turn must be a list of steps, got {type(turn).__name__}")
        for step in turn:
            if episode.done:
                break
            calls = _decode_step(episode, step)
            if calls:
                episode.step_calls(calls)
        if episode.done:
            break
        episode.end_turn()
    return episode.result()


def _decode_step(episode: Episode, step) -> list[Call]:
    if not isinstance(step, list) or not all(isinstance(s, str) for s in step):
        raise ValueError("a step must be a list of call strings")
    calls = []
    for text in step:
        try:
            calls.extend(episode.decode(text))
        except ValueError:
            continue  # the official runner ignores what it cannot decode
    return calls


def replay_ground_truth(entry: BFCLEntry) -> EpisodeResult:
    """The expert trajectory: each turn's ground-truth calls as one step,
    in canonical keyword form."""
    turns = [[[c.canonical() for c in turn]] if turn else [] for turn in ground_truth(entry).calls]
    return replay(entry, turns, positional="drop")
