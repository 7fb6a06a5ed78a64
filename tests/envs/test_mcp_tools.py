"""rcgrpo.envs.mcp_tools against a real MCP server (tests/envs/mcp_server.py) started over stdio.

One server serves the module (it takes about a second to start); the tests
that need a server of their own (close, failed starts) start it themselves.
Tool state is shared by every test using the module's server, so the counter
is checked by how much it moved, never by its value.
"""
from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from rcgrpo.base.errors import UserError
from tests.required import require

require("mcp", "mcp")

from rcgrpo.envs.mcp_tools import MCPServer, MCPToolError  # noqa: E402 (after the check that mcp is installed)

SERVER_SCRIPT = str(Path(__file__).with_name("mcp_server.py"))
SERVER_TOOLS = {"add", "counter_increment", "counter_value", "fail", "sleep", "score", "pid"}


@pytest.fixture(scope="module")
def server():
    server = MCPServer(sys.executable, [SERVER_SCRIPT], call_timeout_s=10.0)
    yield server
    server.close()


@pytest.fixture(scope="module")
def env_class(server):
    return server.environment_factory(reward_tool="score")


def test_tools_are_listed_with_their_input_schemas(server):
    schemas = {schema["function"]["name"]: schema for schema in server.tools()}
    assert set(schemas) == SERVER_TOOLS
    add = schemas["add"]
    assert add["type"] == "function"
    assert add["function"]["description"] == "Add two integers."
    parameters = add["function"]["parameters"]
    assert parameters["type"] == "object"
    assert {name: spec["type"] for name, spec in parameters["properties"].items()} == {"a": "integer", "b": "integer"}
    assert sorted(parameters["required"]) == ["a", "b"]


def test_environment_methods_are_exactly_the_tools_and_carry_their_schemas(server, env_class):
    env = env_class()
    methods = {name for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)}
    assert methods == (SERVER_TOOLS - {"score"}) | {"reset", "get_reward"}  # the reward tool is not offered
    listed = {schema["function"]["name"]: schema for schema in server.tools()}
    for name in SERVER_TOOLS - {"score"}:
        function = getattr(type(env), name)
        assert function.__name__ == name
        assert function.json_schema == listed[name]
        assert getattr(env, name).json_schema == listed[name]  # the bound method shows it too
    assert not hasattr(type(env).reset, "json_schema")


def test_tool_calls_return_text_and_state_lives_in_the_server(env_class):
    first, second = env_class(), env_class()
    assert first.reset(question="anything", answer=1) is None
    assert first.add(a=2, b=3) == "5"
    before = int(first.counter_value())
    first.counter_increment()
    second.counter_increment()
    assert int(env_class().counter_value()) == before + 2  # one server, shared by every instance


def test_reward_comes_from_the_reward_tool(env_class):
    env = env_class()
    count = int(env.counter_increment())
    assert env.get_reward() == pytest.approx(count / 10)


def test_a_failing_tool_raises_with_the_servers_message(env_class):
    with pytest.raises(MCPToolError, match="the disk is full"):
        env_class().fail(message="the disk is full")


def test_a_call_past_its_time_limit_raises_and_the_server_still_answers(server, env_class, monkeypatch):
    monkeypatch.setattr(server, "call_timeout_s", 0.3)
    env = env_class()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"'sleep' did not answer within 0.3 s"):
        env.sleep(seconds=5)
    assert time.monotonic() - start < 1.5
    assert env.add(a=1, b=1) == "2"


def test_calls_from_many_threads(env_class):
    before = int(env_class().counter_value())
    sums, errors = [], []

    def work(offset):
        env = env_class()
        try:
            for i in range(10):
                env.counter_increment()
                sums.append(int(env.add(a=offset, b=i)) == offset + i)
        except Exception as exc:  # collected: an exception in a thread would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(100 * n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len(sums) == 80 and all(sums)
    assert int(env_class().counter_value()) == before + 80


def test_an_unknown_reward_tool_is_a_user_error(server):
    with pytest.raises(UserError, match="reward_tool 'nope' is not a tool"):
        server.environment_factory(reward_tool="nope")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_close_ends_the_server_process():
    server = MCPServer(sys.executable, [SERVER_SCRIPT])
    pid = int(server.call("pid"))
    assert pid != os.getpid() and _alive(pid)
    server.close()
    assert not _alive(pid)
    server.close()  # twice is harmless
    with pytest.raises(MCPToolError, match="is not running"):
        server.call("add", {"a": 1, "b": 2})


@pytest.mark.parametrize("command, args, cause", [
    ("rcgrpo-no-such-mcp-server", [], "No such file or directory"),
    (sys.executable, ["-c", "import sys; sys.exit('cannot load the tools')"], "cannot load the tools"),
    (sys.executable, ["-c", "import sys; sys.stdin.read()"], "did not answer `initialize` within 0.5 s"),
], ids=["bad-command", "exits-at-once", "never-answers"])
def test_a_server_that_does_not_start_is_a_one_line_user_error(command, args, cause):
    start = time.monotonic()
    with pytest.raises(UserError) as raised:
        MCPServer(command, args, startup_timeout_s=0.5)
    message = str(raised.value)
    assert "\n" not in message
    assert f"MCP server `{command}" in message and cause in message
    assert time.monotonic() - start < 2.0


def test_an_mcp_server_trains_as_an_environment(server, tokenizer):
    """The adapter's class is an environment_factory rcgrpo plays unchanged: the
    server's tools in the prompt, calls checked against their input schemas,
    run on the server, their results fed back; the reward from the reward tool."""
    from rcgrpo.data.expert import play_script
    from rcgrpo.envs.tasks import load_tasks
    from rcgrpo.envs.tool_env import ToolEnvironment
    from rcgrpo.rollout.agent_loop import RolloutConfig

    env = ToolEnvironment(environment_factory=server.environment_factory(reward_tool="score")).bind(tokenizer)
    assert {"add", "counter_increment", "fail"} <= set(env.specs) and "score" not in env.specs
    (task,) = load_tasks([{"prompt": "Add 2 and 3."}], env, "train_dataset")
    replies = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
               '<tool_call>{"name": "add", "arguments": {"a": "two", "b": 3}}</tool_call>',
               '<tool_call>{"name": "fail", "arguments": {"message": "no luck"}}</tool_call>', "5"]
    r = play_script(task, tokenizer, replies, RolloutConfig(progress=False, max_total_tokens=4096))
    results = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert results[0] == "5"
    assert results[1].startswith("Error: argument 'a' must be integer")  # refused before reaching the server
    assert "no luck" in results[2] and results[2].startswith("Error:")
    assert '"name":"add"' in tokenizer.decode(r.token_ids[:r.prompt_len])  # the server's schema in the prompt
    assert r.end_reason == "completed" and isinstance(r.reward, float)
