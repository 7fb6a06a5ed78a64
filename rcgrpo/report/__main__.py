"""`python -m rcgrpo.report` (the same as `rcgrpo-report`)."""
import sys

from rcgrpo.report.cli import main

sys.exit(main())
