import pytest

from rcgrpo.envs.bfcl import load_entries


@pytest.fixture(scope="session")
def entries():
    return load_entries()


@pytest.fixture(scope="session")
def by_id(entries):
    return {e.id: e for e in entries}
