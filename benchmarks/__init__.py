"""The benchmark suite: ``pytest benchmarks/ --benchmark-only``.

A package so that what must run in a fresh process is a module
(``python -m benchmarks.<program>``), linted and imported like the rest of
the tree. ``test_*.py`` files are the measurements pytest collects; the other
modules are the programs they start and the scoreboard they fill.
"""
