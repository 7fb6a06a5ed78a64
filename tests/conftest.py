"""Settings and shared, expensive fixtures for the whole suite.

The real SmolLM2 policy is loaded once per session, here, for every folder
that needs it. The in-process vLLM engine is built once too, but lives only
while the tests that use it run: they are run as one block (see
`pytest_collection_modifyitems`) and the engine is closed right after the
last of them, so its model copy and KV cache do not sit beside the rest of
the suite (torchrun jobs, TRL's trainer, the training tests). After each
module the memory it freed goes back to the OS (`_trim_heap`).

Slow tests carry the `slow` marker (`make test-fast` deselects them); a test
that needs the policy or the engine is marked here, whatever its own time,
because in a run without slow tests nothing should load the 135M model.
"""
import ctypes
import os

import pytest
from hypothesis import settings

from tests.required import require

# No test has a wall-clock limit (the machines are shared and noisy):
# hypothesis's default 200 ms deadline per example is turned off everywhere.
settings.register_profile("rcgrpo", deadline=None)
settings.load_profile("rcgrpo")

# Before vLLM is imported anywhere: keep the engine in this process, with a
# small KV cache (GiB) that fits beside the HF model.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

MAX_MODEL_LEN = 8192
ENGINE = "vllm_engine"
HEAVY = {"policy", ENGINE}  # fixtures that load the 135M model: their tests are slow


@pytest.fixture(scope="session")
def model_dir():
    from rcgrpo.model.loading import resolve_model_folder

    return resolve_model_folder(None)  # the embedded SmolLM2 (converted once, cached)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    # From the folder, not from the policy: tests that only tokenise do not
    # pay for the model (the policy's tokenizer is an equal copy).
    from rcgrpo.model.loading import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    """A tiny random Llama with the real token-extended tokenizer, saved as a
    model folder (tests.training.conftest.save_tiny_llama), one per test
    module: fast updates on real BFCL prompts."""
    from tests.training.conftest import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), tokenizer)


@pytest.fixture(scope="session")
def policy(model_dir):
    from rcgrpo.model.loading import load_policy

    return load_policy(model_dir)


@pytest.fixture(scope="session")
def vllm_engine(policy):
    """One engine for every test that needs it; tests that change its weights
    put the originals back. Closed after the last such test (see the hooks
    below), or at the session's end if the run stops early."""
    require("vllm", "cpu")
    from rcgrpo.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(policy.path, max_model_len=MAX_MODEL_LEN, debug=True)
    _open_engines.append(engine)
    yield engine
    _close_engines()


@pytest.fixture(scope="session")
def entries():
    """The training split. tests/envs overrides this with every entry."""
    from rcgrpo.envs.bfcl import load_entries, split_train_test

    train, _ = split_train_test(load_entries())
    return train


@pytest.fixture
def chat_ids(tokenizer):
    def make(text, system="You are a helpful assistant."):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        return tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]

    return make


# -- the engine's block, and memory between modules -----------------------------
_open_engines: list = []
_last_engine_test: list[str] = []  # nodeid of the run's last test that uses the engine


def _close_engines() -> None:
    while _open_engines:
        _open_engines.pop().close()


def _trim_heap() -> None:
    """Give the pages of freed memory back to the OS. glibc keeps them in its
    heap for reuse by this process, where they still count as used; the next
    module's subprocesses (torchrun ranks, CLIs) cannot reuse them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _uses_engine(item) -> bool:
    return ENGINE in getattr(item, "fixturenames", ())


def _module(item):
    return getattr(item, "module", None)


@pytest.hookimpl(tryfirst=True)  # the marks below must exist before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """Run every module that has an engine test as one block, where the first
    of them would have run, each module's own order kept (whole modules move,
    so module-scoped fixtures are still set up once). The engine is then
    built once and alive only during that block."""
    for item in items:
        if HEAVY & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    engine_modules = {_module(item) for item in items if _uses_engine(item)}
    if not engine_modules:
        return
    block = [item for item in items if _module(item) in engine_modules]
    first = next(i for i, item in enumerate(items) if _module(item) in engine_modules)
    rest = [item for item in items if _module(item) not in engine_modules]
    items[:] = rest[:first] + block + rest[first:]


def pytest_collection_finish(session):
    # After deselection (-m, -k): the engine's last user in what will run.
    users = [item.nodeid for item in session.items if _uses_engine(item)]
    _last_engine_test[:] = users[-1:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # After the item's own teardown (its module's fixtures, which may hold
    # engine outputs, go first): free the engine once nothing else needs it,
    # and at the end of each module what the module freed.
    result = yield
    if _last_engine_test and item.nodeid == _last_engine_test[0]:
        _close_engines()
    if nextitem is None or _module(nextitem) is not _module(item):
        _trim_heap()
    return result
