"""Evaluation on BFCL v4 multi-turn, scored by the official checker.

* ``rollouts``: a policy's rollouts, one per entry, tabulated per category
  like the paper (eval.json / eval.md); the trainer's eval stage calls it.
* ``replay_scoring``: recorded call strings, or the ground truth, replayed
  without a policy.
* ``settings``: which generation settings and reward token a saved model is
  evaluated under.
* ``cli``: ``python -m rcgrpo.eval`` / ``rcgrpo-eval`` (rcgrpo/eval.py runs it).

Nothing is imported here: the command's replay modes never load torch.
"""
