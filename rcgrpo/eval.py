"""`python -m rcgrpo.eval`: the evaluation command (rcgrpo.evaluation.cli).

Kept as a module of its own so that `python -m rcgrpo.eval` and the
`rcgrpo-eval` script keep their name; the command lives in the package.
"""
import sys

from rcgrpo.evaluation.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
