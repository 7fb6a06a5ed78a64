"""rcgrpo.envs.openenv_tools against a real OpenEnv server on loopback.

The server (tests/envs/openenv_toy_server.py) runs openenv-core's own server
app under uvicorn in a subprocess, bound to 127.0.0.1 on a port the OS picks;
it serves a plain action env at /guess and an MCP tool env at /tools. One
server serves the module: starting it imports gradio (about 5 s on 2 cores),
so the tests that use it are marked slow. The unreachable-server tests need
neither the server nor openenv's import and stay fast.
"""
from __future__ import annotations

import inspect
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rcgrpo.base.errors import UserError
from rcgrpo.envs.openenv_tools import OpenEnvToolError, openenv_environment_factory
from rcgrpo.envs.tools import environment_methods, tool_schema
from tests.required import require

SERVER_SCRIPT = str(Path(__file__).with_name("openenv_toy_server.py"))
START_LIMIT_S = 90.0  # gradio's import on a busy 2-core machine


@pytest.fixture(scope="module")
def server_url():
    require("openenv", "openenv")
    proc = subprocess.Popen([sys.executable, SERVER_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first_line: list[str] = []
    reader = threading.Thread(target=lambda: first_line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(START_LIMIT_S)
    try:
        match = re.match(r"PORT (\d+)", first_line[0] if first_line else "")
        if not match:
            proc.kill()
            err = proc.communicate(timeout=10)[1]
            pytest.fail(f"the OpenEnv toy server did not start: {err.strip().splitlines()[-1:] or 'no output'}")
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def guess_factory(server_url):
    factory = openenv_environment_factory(f"{server_url}/guess", reset_keys=("seed", "target"),
                                          message_timeout_s=10.0)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def tools_factory(server_url):
    factory = openenv_environment_factory(f"{server_url}/tools", message_timeout_s=10.0)
    yield factory
    factory.close()


def _trl_tools(env) -> dict:
    """The tools TRL would find: public functions of the class other than reset/get_reward."""
    return {fn.__name__: fn for fn in environment_methods(env)}


def _check_transformers_schema(method) -> None:
    """get_json_schema (TRL's path) gives back the schema the server published."""
    from transformers.utils import get_json_schema

    exact = method.json_schema["function"]
    derived = get_json_schema(method)["function"]
    assert derived["name"] == exact["name"]
    assert derived["description"] == " ".join(exact["description"].split())
    assert set(derived["parameters"]["properties"]) == set(exact["parameters"]["properties"])
    for name, prop in derived["parameters"]["properties"].items():
        assert prop["type"] == exact["parameters"]["properties"][name]["type"]
        assert prop["description"] == exact["parameters"]["properties"][name]["description"]
    assert set(derived["parameters"].get("required", ())) == set(exact["parameters"].get("required", ()))


@pytest.mark.slow
def test_action_env_schema(guess_factory):
    assert guess_factory.kind == "action"
    env = guess_factory()
    tools = _trl_tools(env)
    assert list(tools) == ["guess"]
    schema = tool_schema(tools["guess"])
    assert schema == guess_factory.tools[0]
    params = schema["function"]["parameters"]
    assert params["properties"]["guess"]["type"] == "integer"
    assert "metadata" not in params["properties"]  # OpenEnv's own field, not the model's
    assert params["required"] == ["guess"]
    _check_transformers_schema(tools["guess"])


@pytest.mark.slow
def test_action_env_episode(guess_factory):
    env = guess_factory()
    first = env.reset(prompt=[{"role": "user", "content": "play"}], seed=1, target=4)
    assert first == "I picked a number between 1 and 10."
    assert env.guess(guess=2) == "No, go higher."
    assert env.guess(guess=9) == "No, go lower."
    assert not env.done
    assert env.guess(guess=4) == "Correct!"
    assert env.done
    assert env.get_reward() == pytest.approx(0.8)  # reset 0.0, two misses -0.1 each, the hit 1.0
    with pytest.raises(OpenEnvToolError, match="over"):
        env.guess(guess=4)
    env.reset(target=7)  # same instance, same session, new episode
    assert env.get_reward() == 0.0 and not env.done
    with pytest.raises(OpenEnvToolError, match="no argument"):
        env.guess(number=7)
    with pytest.raises(OpenEnvToolError, match="VALIDATION_ERROR"):  # the server's own check
        env.guess(guess="seven")
    assert env.guess(guess=7) == "Correct!"  # the session survived the refused steps
    assert env.get_reward() == pytest.approx(1.0)


@pytest.mark.slow
def test_instances_have_their_own_sessions(guess_factory, server_url):
    a, b = guess_factory(), guess_factory()
    a.reset(target=3)
    b.reset(target=8)
    assert a.guess(guess=8) == "No, go lower."
    assert b.guess(guess=8) == "Correct!"
    assert not a.done and b.done
    last = openenv_environment_factory(f"{server_url}/guess", reset_keys=("target",), reward="last")
    try:
        env = last()
        env.reset(target=2)
        env.guess(guess=1)
        env.guess(guess=2)
        assert env.get_reward() == 1.0
    finally:
        last.close()


@pytest.mark.slow
def test_closed_session_is_reopened_by_reset(guess_factory):
    env = guess_factory()
    env.reset(target=5)
    guess_factory.close()
    with pytest.raises(OpenEnvToolError, match="no episode"):
        env.guess(guess=5)
    assert env.reset(target=5) == "I picked a number between 1 and 10."
    assert env.guess(guess=5) == "Correct!"


@pytest.mark.slow
def test_mcp_env_tools_and_episode(tools_factory):
    assert tools_factory.kind == "mcp"
    env = tools_factory()
    tools = _trl_tools(env)
    assert set(tools) == {"add", "submit"}
    add = tool_schema(tools["add"])["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first addend."}
    assert sorted(add["parameters"]["required"]) == ["a", "b"]
    for method in tools.values():
        _check_transformers_schema(method)

    task = env.reset(seed=3, prompt="ignored: not a reset key")
    x, y = map(int, re.findall(r"\d+", task))
    assert env.add(a=x, b=y) == str(x + y)
    assert not env.done and env.get_reward() == 0.0
    with pytest.raises(OpenEnvToolError, match="add"):
        env.add(a="x", b=1)  # the MCP tool's own argument check
    assert env.submit(answer=x + y) == "right"
    assert env.done and env.get_reward() == 1.0

    env.reset(seed=3)
    assert env.submit(answer=-1) == "wrong"
    assert env.get_reward() == 0.0


def test_unreachable_url_fails_in_one_line_quickly():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(UserError) as info:
            openenv_environment_factory(url, connect_timeout_s=1.0, message_timeout_s=1.0)
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert "\n" not in message and url in message and "cannot be reached" in message


def test_silent_server_times_out_in_one_line():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)  # accepts the connection but never answers
        port = sock.getsockname()[1]
        url = f"ws://127.0.0.1:{port}/"
        start = time.monotonic()
        with pytest.raises(UserError) as info:
            openenv_environment_factory(url, connect_timeout_s=0.3, message_timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert "\n" not in message and f"http://127.0.0.1:{port}" in message


def test_bad_options_are_user_errors():
    with pytest.raises(UserError, match="kind"):
        openenv_environment_factory("http://127.0.0.1:1", kind="gym")
    with pytest.raises(UserError, match="reward"):
        openenv_environment_factory("http://127.0.0.1:1", reward="mean")


def test_tool_class_has_only_contract_methods():
    # Without a server: the base class must expose no public function TRL would take for a tool.
    from rcgrpo.envs.openenv_tools import OpenEnvEnvironment

    public = {name for name, _ in inspect.getmembers(OpenEnvEnvironment, predicate=inspect.isfunction)
              if not name.startswith("_")}
    assert public == {"reset", "get_reward"}
