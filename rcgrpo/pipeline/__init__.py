"""A run of the paper's pipeline: the stages as objects with one ``run``
entry each and the registry of them by name (``stages``), the run's one
rollout engine (``engine``), the checks made before a run folder is claimed
(``prepare``), claiming and holding the folder (``claim``), whether a run
may be resumed (``resume``) and a finished stage's Hub push (``push``).
``rcgrpo.train`` loops over these stages.

May import: every package of rcgrpo.
"""
