"""The modules the layout renovation moved (issue 26) still import under
their old paths for one release (rcgrpo/moved.py): each old path is the very
module at its new path, not a copy, and says so with a DeprecationWarning.
(The split rcgrpo.training.grpo: tests/training/test_grpo_split.py.)"""
import importlib
import re
import subprocess
import sys

import pytest

from rcgrpo.moved import MOVED


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_an_old_path_is_the_moved_module_with_a_warning(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # its own spec back, so a reload reloads the real module


@pytest.mark.slow  # a fresh interpreter is the subject (~2 s)
def test_an_old_from_import_works_in_a_fresh_process():
    """As user code written against 0.1 does it: `from rcgrpo.X import name`."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    from rcgrpo.models import load_tokenizer\nexcept DeprecationWarning as w:\n    print(w)\n"
            "warnings.simplefilter('ignore')\n"
            "from rcgrpo.models import load_tokenizer\nfrom rcgrpo.model.loading import load_tokenizer as new\n"
            "assert load_tokenizer is new\nprint('same')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["rcgrpo.models moved to rcgrpo.model.loading; the old path goes in rcgrpo 0.2",
                                       "same"]
