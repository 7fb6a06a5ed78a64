"""The names of the RCTP set's failure sources (`rctp.failure_source`); no
imports, so that the config can take them without torch. What each one is:
rcgrpo/data/rctp.py.

* rollouts: reward-0 rollouts of the starting model (the paper's source:
  base-model exploration rollouts);
* near_miss: the expert trajectory with one call dropped or one argument
  changed, kept when executing it gives reward 0;
* late_divergence: reward-0 rollouts whose first divergence from the expert
  comes at least `rctp.min_divergence_tokens` generated tokens into the reply.
"""

FAILURE_SOURCES = ("rollouts", "near_miss", "late_divergence")
