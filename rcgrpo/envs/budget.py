"""What one episode may make the environment do: calls per reply, tool text,
environment time.

Model output decides how much work the environment does, so each episode
carries a budget, spent as its calls run. The bounds sit far above what real
trajectories need: over all 800 entries the ground truth makes at most 34
calls in one turn, writes at most 31,706 characters in one tool result
(long_context's stock listings) and 70,454 in one episode, in about 2 ms of
environment time. The official pipeline has none of these bounds; none of
them changes what a ground-truth trajectory sees or scores.

Past a bound:
* calls beyond `calls_per_reply` in one reply do not run; each gets an error
  result saying so (the official checker sees a step that changed nothing);
* a tool result is cut to `tool_text_chars` characters, and once the episode's
  results have reached `episode_tool_text_chars` every later one is cut to
  what is left, each with a marker saying how much was cut and why;
* once `env_seconds` of environment time is spent, no further call runs and
  the episode ends (`ENV_TIME_LIMIT`) with reward 0; the call running when
  the budget ends is stopped at the budget (its own time bound is cut to what
  is left).
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_CALLS_PER_REPLY = 64
MAX_TOOL_TEXT_CHARS = 100_000
MAX_EPISODE_TOOL_TEXT_CHARS = 400_000
MAX_EPISODE_ENV_SECONDS = 30.0

# End reasons of an episode stopped by its budget: cut short, reward 0.
ENV_TIME_LIMIT = "env_time_limit"
CALL_DID_NOT_STOP = "call_did_not_stop"


@dataclass
class EpisodeBudget:
    calls_per_reply: int = MAX_CALLS_PER_REPLY
    tool_text_chars: int = MAX_TOOL_TEXT_CHARS
    episode_tool_text_chars: int = MAX_EPISODE_TOOL_TEXT_CHARS
    env_seconds: float = MAX_EPISODE_ENV_SECONDS
    text_spent: int = 0
    seconds_spent: float = 0.0

    def __post_init__(self):
        for name in ("calls_per_reply", "tool_text_chars", "episode_tool_text_chars", "env_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"episode budget: {name} must be > 0, got {getattr(self, name)!r}")

    @property
    def seconds_left(self) -> float:
        return self.env_seconds - self.seconds_spent

    def spend_seconds(self, seconds: float) -> None:
        self.seconds_spent += seconds

    def over_calls(self, index: int) -> str | None:
        """Why the `index`-th call of a reply may not run (None: it may)."""
        if index >= self.calls_per_reply:
            return f"not run: a reply may make at most {self.calls_per_reply} calls"
        if self.seconds_left <= 0:
            return f"not run: this episode's {self.env_seconds:g} s of environment time is spent"
        return None

    def clip(self, text: str) -> str:
        """`text` as the model may see it, charged to the episode's budget."""
        room = min(self.tool_text_chars, self.episode_tool_text_chars - self.text_spent)
        if len(text) <= room:
            self.text_spent += len(text)
            return text
        room = max(room, 0)
        self.text_spent += room
        why = (f"a tool result may show at most {self.tool_text_chars} characters" if room == self.tool_text_chars
               else f"this episode's tool results reached {self.episode_tool_text_chars} characters")
        return f"{text[:room]}... [{len(text) - room} more characters cut: {why}]"
