"""Import bfcl_eval safely: its config module creates result/score folders
under BFCL_PROJECT_ROOT (default: inside site-packages) when imported, so
point it at a scratch folder first. Every rcgrpo module that imports
bfcl_eval imports this one before it."""
import os
from pathlib import Path

os.environ.setdefault(
    "BFCL_PROJECT_ROOT",
    str(Path(os.environ.get("RCGRPO_CACHE", Path.home() / ".cache" / "rcgrpo")) / "bfcl"),
)
