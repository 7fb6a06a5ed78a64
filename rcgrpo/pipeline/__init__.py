"""A run of the paper's pipeline: the stages as objects with one ``run``
entry each (``stages``), the run's one rollout engine (``engine``), the
checks made before a run folder is claimed (``prepare``) and whether a run
may be resumed (``resume``). ``rcgrpo.train`` loops over these stages.

May import: every package of rcgrpo.
"""
