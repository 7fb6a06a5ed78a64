"""`import kernels`: rcgrpo's GRPO kernels under their first name.

The stable name is ``rcgrpo_kernels``, and rcgrpo imports nothing else. This
module keeps ``import kernels`` (and ``kernels.dispatch``,
``kernels.triton.loss``, ...) working for GRPO code written against the first
name. The names are the very ``rcgrpo_kernels`` modules, not copies, so a loss
type registered through one name is seen through the other, and the Triton
modules are still imported only when first used.

Hugging Face ships another package under this name (PyPI ``kernels``, hub
kernels; transformers and TRL import it). Where it is installed, ``import
kernels`` must give Hugging Face's package, or transformers breaks. Installed
side by side in one site-packages, Python already picks their package folder
over this one-file module. Where this module is found first anyway (a
checkout's root on ``sys.path``), it loads Hugging Face's package in its place
and says so in one line.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys

STABLE_NAME = "rcgrpo_kernels"

_HERE = os.path.dirname(os.path.abspath(__file__))


def _hugging_face_spec():
    """The spec of a ``kernels`` package elsewhere on sys.path, or None.

    Only a regular package counts: a namespace folder (say, a checkout's old
    ``kernels/`` holding nothing but ``__pycache__``) or another copy of this
    module is not Hugging Face's package."""
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec(__name__, elsewhere)
    if spec is None or spec.submodule_search_locations is None or not spec.has_location:
        return None
    return spec


class _SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``kernels.X`` -> the module ``rcgrpo_kernels.X`` itself, imported when asked for."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + ".") or sys.modules.get(__name__) is not _stable:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(STABLE_NAME + spec.name[len(__name__):])
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias's spec on the module; give it its own back.
        module.__spec__ = self._own_spec


_hugging_face = _hugging_face_spec()
if _hugging_face is not None:
    _theirs = importlib.util.module_from_spec(_hugging_face)
    sys.modules[__name__] = _theirs  # what `import kernels` returns, from here on
    try:
        _hugging_face.loader.exec_module(_theirs)
    except BaseException:
        del sys.modules[__name__]
        raise
    # No handler configured: logging's last resort prints the bare message, one line on stderr.
    logging.getLogger(STABLE_NAME).warning(
        "kernels: Hugging Face's `kernels` package is installed (%s), so `import kernels` gives it; "
        "import rcgrpo's kernels as `%s`", os.path.dirname(_hugging_face.origin), STABLE_NAME)
else:
    _stable = importlib.import_module(STABLE_NAME)
    sys.modules[__name__] = _stable
    if not any(isinstance(f, _SubmoduleAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, _SubmoduleAlias())
