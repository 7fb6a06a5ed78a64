"""transformers treats an importable top-level `kernels` module as the Hugging
Face kernels-hub package when its version looks new enough; ours must never
be mistaken for it (tests/kernels/test_kernels_import.py checks the same from
the kernels' side)."""
import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.slow  # a subprocess imports transformers (~2-2.5 s)
def test_transformers_does_not_take_our_kernels_for_the_hub_package():
    assert importlib.util.find_spec("kernels") is not None, "the project's kernels package is not importable"
    code = (
        "import kernels, transformers.utils.import_utils as iu; "
        "assert kernels.__file__ and 'site-packages/kernels/' not in kernels.__file__; "
        "print(iu.is_kernels_available())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
