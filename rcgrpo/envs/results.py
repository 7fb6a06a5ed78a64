"""What one reply and one whole episode come to, for every environment
(rcgrpo.envs.episode says how the agent loop drives an episode)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    calls: list[Any]
    # One {"role": "tool", "name": call, "content": result} per call, in order.
    tool_messages: list[dict[str, str]]
    turn_ended: bool
    done: bool
    # Why the reply (or some of its calls) could not be decoded safely; the
    # rejected calls' tool messages carry the same reason to the model.
    decode_error: str | None = None


@dataclass
class EpisodeResult:
    entry_id: str
    reward: float
    r_state: float  # BFCL's state check; other environments: the reward
    r_action: float  # BFCL's action check; other environments: the reward
    valid: bool  # BFCL: the official checker's verdict; other environments: reward >= the success threshold
    verdict_error: str | None
    turns: int  # turns completed
    steps: int  # model replies consumed
    end_reason: str
    executed_calls: list[str] = field(default_factory=list)
