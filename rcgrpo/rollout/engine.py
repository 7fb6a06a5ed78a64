"""The contract every rollout engine meets: token ids in, token ids (+ log-probs) out.

Prompts are token id lists, never text: the agent loop owns tokenisation, so
the ids the trainer scores are exactly the ids the engine consumed or produced.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol, Sequence, TypeVar, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 256
    n: int = 1  # samples per prompt
    seed: int | None = None  # per request where the engine supports it
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-turn token
    logprobs: bool = True


@dataclass
class Generation:
    token_ids: list[int]  # sampled ids, including the end-of-turn id if sampled
    logprobs: list[float] | None  # log pi(token) at the sampling temperature
    finish_reason: str  # "stop" (end-of-turn or stop id) or "length"


@runtime_checkable
class Engine(Protocol):
    name: str
    supports_sleep: bool

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig | Sequence[SamplingConfig],
    ) -> list[list[Generation]]:
        """One list of `n` generations per prompt, in prompt order."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the policy weights in place (HF parameter names)."""

    def sleep(self) -> None:
        """Free memory between rollout phases (vLLM: its KV cache, and on CUDA
        its weights too; no-op where unsupported)."""

    def wake_up(self) -> None:
        """Undo sleep() before the next generate()."""


@contextmanager
def awake(engine: Engine, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> Iterator[Engine]:
    """One rollout phase: wake the engine, load `weights` if given (the swap
    happens awake: a sleeping vLLM engine has no weights to overwrite), hand
    it over, and put it back to sleep afterwards, so that the update that
    follows has the memory (vLLM on CPU: the KV cache's). For the HF engine
    sleep/wake are no-ops."""
    engine.wake_up()
    try:
        if weights is not None:
            engine.load_weights(weights)
        yield engine
    finally:
        engine.sleep()


class EngineFault(RuntimeError):
    """The engine returned what a healthy engine cannot: a non-finite log-prob
    for a token it sampled (a sampled token has probability > 0). Seen in
    the learning study on CPU: whole phases of garbage replies with NaN
    log-probs, cause unknown (README.md, "The rollout engine between
    phases"). Such rollouts must never be trained on or counted."""


def check_generations(engine: Engine, outputs: Sequence[Sequence[Generation]]) -> None:
    """Raise EngineFault if any sampled token's log-prob is NaN or infinite."""
    for gens in outputs:
        for g in gens:
            bad = next((x for x in g.logprobs or () if not math.isfinite(x)), None)
            if bad is not None:
                raise EngineFault(f"the {engine.name} engine returned a non-finite log-prob ({bad}) for a sampled "
                                  "token")


T = TypeVar("T")


def play_awake(engine: Engine, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
               play: Callable[[Engine], T], what: str, attempts: int = 3, warn: Callable[[str], None] = print,
               replay: bool = True) -> tuple[T, int]:
    """`play(live)` in one awake phase holding `weights()`; returns its result
    and the number of replays. On an EngineFault the phase ends, the weights
    are pushed again in a fresh phase and `play` runs again (its seeds make
    the replay the same rollouts a healthy engine would have played), up to
    `attempts` phases in all; then the fault is raised. `replay=False` (under
    torchrun, where a replay on one rank would leave the others in the
    weight push's collective) raises on the first fault."""
    replays = 0
    while True:
        try:
            with awake(engine, weights()) as live:
                return play(live), replays
        except EngineFault as exc:
            if not replay or replays + 1 >= attempts:
                raise EngineFault(f"{what}: {exc}, in {replays + 1} awake phase(s) with freshly pushed weights; "
                                  "the run stops here (resume it with --resume from its last checkpoint)") from exc
            replays += 1
            warn(f"warning: {what}: {exc}; pushing the weights again and replaying (seeded: same rollouts)")


# Wrappers a trainer may leave on parameter names (DDP, torch.compile, PEFT).
_NAME_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")


def strip_wrapper_prefixes(name: str) -> str:
    """`module._orig_mod.model.norm.weight` -> `model.norm.weight`."""
    changed = True
    while changed:
        changed = False
        for prefix in _NAME_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def per_prompt(sampling: SamplingConfig | Sequence[SamplingConfig], n_prompts: int) -> list[SamplingConfig]:
    if isinstance(sampling, SamplingConfig):
        return [sampling] * n_prompts
    sampling = list(sampling)
    if len(sampling) != n_prompts:
        raise ValueError(f"{len(sampling)} sampling configs for {n_prompts} prompts")
    return sampling
