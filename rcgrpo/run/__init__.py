"""A run's folder, ``runs/<name>/``: where every file of it lives, the one
place its paths are joined (``folder``), the lock that keeps one run per
folder (``lock``), the per-step metrics and their trackers (``metrics``,
``trackers``) and the checkpoints an unfinished stage resumes from
(``checkpoint``).

May import: ``rcgrpo.base`` and ``rcgrpo.conditioning`` (the reward tokens'
names in metric keys).
"""
