"""`python -m rcgrpo.config [flags]`: print the resolved configuration as TOML."""
import sys

from rcgrpo.config.cli import main

sys.exit(main())
