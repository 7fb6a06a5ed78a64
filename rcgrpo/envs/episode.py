"""What an episode is to the agent loop, whichever environment plays it.

An episode is one rollout's play-through of one task, on state nobody else
sees. The agent loop (rcgrpo.rollout.agent_loop) drives any episode through
the same few members:

* ``done`` / ``end_reason``; ``finish(reason)`` stops it early (idempotent);
* the opening prompt: BFCL's episode gives its function docs and first turn
  (rcgrpo.conditioning.prompts builds its system prompt); an environment
  under the TRL contract gives ``opening_messages()`` and, when its chat
  template renders tools itself, ``template_tools``;
* a reply: ``step(text)`` (BFCL) or ``step_reply(ids, text, conversation_ids)``
  (TRL-contract environments, whose parser may read the ids) -> `StepResult`;
  ``turn_messages()`` opens the next user turn after a turn ended;
* ``result()`` -> `EpisodeResult` (ends the episode; rcgrpo.envs.results).

`new_episode` gives a task its episode: a task that knows its environment
makes its own (``task.new_episode()``); a BFCL entry gets BFCL's.
"""
from __future__ import annotations


def new_episode(task, **options):
    """A fresh episode of `task` (`options`: BFCL episode settings, for a BFCL entry)."""
    make = getattr(task, "new_episode", None)
    if make is not None:
        return make()
    from rcgrpo.envs.bfcl import Episode

    return Episode(task, **options)
