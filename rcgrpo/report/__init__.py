"""What a person reads after a run: ``report.md`` and its summary of what
was learnt (``summary``), the PNG plots (``plots``) and ``rcgrpo-report`` /
``python -m rcgrpo.report`` (``cli``). It only reads a run folder.

May import: every package below ``rcgrpo.pipeline``.
"""
from rcgrpo.report.summary import *  # noqa: F403  (the door: `from rcgrpo.report import write_report`)
from rcgrpo.report.summary import __all__  # noqa: F401
