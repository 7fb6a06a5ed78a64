"""A component the installed extras require fails the suite when it is
missing or broken; it skips only where RCGRPO_TEST_WITHOUT names it."""
from pathlib import Path

import pytest

from tests.required import WITHOUT_ENV, require


def test_a_broken_required_component_fails_instead_of_skipping(tmp_path, monkeypatch):
    (tmp_path / "half_installed.py").write_text("raise RuntimeError('half installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(WITHOUT_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match="required by the 'cpu' extra .*half installed"):
        require("half_installed", "cpu")
    monkeypatch.setenv(WITHOUT_ENV, "vllm,half_installed")
    with pytest.raises(pytest.skip.Exception, match=WITHOUT_ENV):
        require("half_installed", "cpu")


def test_no_test_skips_on_a_failed_import():
    """`pytest.importorskip` would turn a broken install green: tests use `require`."""
    tests = Path(__file__).parent
    offenders = [str(p.relative_to(tests)) for p in tests.rglob("*.py")
                 if p.name != Path(__file__).name and "importorskip(" in p.read_text()]
    assert offenders == []
