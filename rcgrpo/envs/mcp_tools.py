"""The tools of an MCP server as a TRL-style environment (`environment_factory`).

TRL's `GRPOTrainer` takes `environment_factory`: a zero-argument callable whose
instances have `reset(**row)`, optionally `get_reward()`, and one public method
per tool. Many tool sets already exist as MCP servers (Model Context Protocol);
`MCPServer` starts one over stdio and builds such an environment class from the
tools it lists, so a run can train on them without a line of glue:

    server = MCPServer("python", ["my_server.py"])
    trainer = GRPOTrainer(..., environment_factory=server.environment_factory(reward_tool="score"))

The class is built at run time, one plain function per MCP tool, because the
tools are found with `inspect.isfunction` on the class. Each function carries
its schema in a `json_schema` attribute (`{"type": "function", "function":
{"name", "description", "parameters": inputSchema}}`), since an MCP tool's
schema is known and there is no docstring to parse.

One server process serves every environment instance of one `MCPServer`:
instances are cheap proxies, and whatever state the tools keep lives in the
server, shared by all rollouts. A server whose episodes need their own state
must key it itself (or be started once per rollout group by the caller).

The MCP client is asynchronous: one event loop, on a daemon thread, holds the
session for the server's life, and every synchronous call is a coroutine sent
to that loop (`asyncio.run_coroutine_threadsafe`), which makes calls from any
number of threads safe. A call past its time limit raises `TimeoutError` and
is cancelled on the loop; the caller never waits longer than the limit.
The server's stderr goes to a temporary file whose last line explains a server
that will not start. `close()` ends the server (the SDK closes its stdin, then
terminates its process group); it is registered with `atexit` too, so a run
never leaves the process behind.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import os
import shlex
import tempfile
import threading
from typing import Any, Mapping, Optional, Sequence

from rcgrpo.base.errors import UserError, one_line

__all__ = ["MCPServer", "MCPToolError", "MCPEnvironment"]

# How long close() waits for the session to wind down: the SDK gives a server
# 2 s to exit after its stdin closes, then 2 s after SIGTERM before SIGKILL.
CLOSE_TIMEOUT_S = 10.0
# On top of startup_timeout_s: the time the SDK may take to stop a server that
# did not answer, before the start's failure is reported.
STARTUP_STOP_GRACE_S = CLOSE_TIMEOUT_S
STDERR_TAIL_BYTES = 4096
# The environment contract's own methods: an MCP tool cannot take these names.
RESERVED_NAMES = ("reset", "get_reward")


class MCPToolError(RuntimeError):
    """An MCP tool failed: the server said so (`isError`) or the protocol did; carries the server's text."""


class MCPEnvironment:
    """Base of the classes `MCPServer.environment_factory` builds; its subclasses add one method per tool."""

    _server: "MCPServer"
    _reset_tool: Optional[str] = None

    def reset(self, **row: Any) -> None:
        """Start an episode. The state lives in the server; with a `reset_tool`, that tool is called first."""
        if self._reset_tool is not None:
            self._server.call(self._reset_tool, {})
        return None


class MCPServer:
    """One MCP server process, spoken to over stdio, and the environment class built from its tools."""

    def __init__(self, command: str, args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
                 cwd: Optional[str | os.PathLike] = None, call_timeout_s: float = 30.0,
                 startup_timeout_s: float = 60.0):
        """Start the server and list its tools; a server that does not start raises `UserError`.

        `env` is added to the few variables the MCP SDK passes on by default
        (HOME, PATH, SHELL, TERM, USER, LOGNAME), not to the whole environment.
        """
        self.command = command
        self.args = list(args)
        self.call_timeout_s = call_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self._lock = threading.Lock()
        self._closed = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._session: Any = None
        # Binary and read with os.pread: the server shares this file's offset, which must stay at its end.
        self._stderr = tempfile.TemporaryFile(prefix="rcgrpo-mcp-stderr-")
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(ready),),
                                        name=f"mcp-server {command}", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        try:
            self._tools = ready.result(timeout=startup_timeout_s + STARTUP_STOP_GRACE_S)
        except (KeyboardInterrupt, SystemExit):
            self.close()
            raise
        except BaseException as exc:  # whatever stopped the start is its cause, in one line
            cause = self._startup_cause(exc)
            self.close()
            raise UserError(one_line(f"MCP server `{self.command_line}` did not start: {cause}")) from None

    @property
    def command_line(self) -> str:
        return shlex.join([self.command, *self.args])

    def tools(self) -> list[dict]:
        """The server's tools in the OpenAI/transformers form: {"type": "function", "function": {...}}."""
        return [_tool_schema(tool) for tool in self._tools]

    def call(self, name: str, arguments: Optional[Mapping[str, Any]] = None,
             timeout_s: Optional[float] = None) -> str:
        """Call tool `name` and return its text; raises `MCPToolError` if it fails, `TimeoutError` past the limit."""
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        future = self._submit(self._call_tool(name, dict(arguments or {})))
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            future.cancel()  # cancels the request's task on the loop; a late answer is dropped
            raise TimeoutError(f"MCP tool {name!r} did not answer within {limit:g} s") from None
        except concurrent.futures.CancelledError:
            raise MCPToolError(f"MCP tool {name!r}: the server was closed during the call") from None

    def environment_factory(self, reward_tool: Optional[str] = None,
                            reset_tool: Optional[str] = None) -> type[MCPEnvironment]:
        """The environment class: one method per tool, named after it, with the tool's schema as `json_schema`.

        `reward_tool` (a tool taking no arguments whose text is a number)
        becomes `get_reward()`; `reset_tool` (no arguments) is called by
        `reset()`. Neither is offered to the model as a tool. The class takes
        no arguments, so it is itself the factory.
        """
        names = [tool.name for tool in self._tools]
        for role, chosen in (("reward_tool", reward_tool), ("reset_tool", reset_tool)):
            if chosen is not None and chosen not in names:
                raise UserError(f"{role} {chosen!r} is not a tool of MCP server `{self.command_line}`; "
                                f"its tools: {', '.join(names)}")
        namespace: dict[str, Any] = {"_server": self, "_reset_tool": reset_tool,
                                     "__doc__": f"The tools of MCP server `{self.command_line}`."}
        for schema in self.tools():
            name = schema["function"]["name"]
            if name in (reward_tool, reset_tool):
                continue
            if name in RESERVED_NAMES or name.startswith("_"):
                raise UserError(f"MCP server `{self.command_line}` has a tool named {name!r}, which an environment "
                                f"cannot offer as a tool (reserved or private); name it as reward_tool/reset_tool "
                                "or rename it in the server")
            namespace[name] = _tool_method(name, schema)
        if reward_tool is not None:
            namespace["get_reward"] = _reward_method(reward_tool)
        return type("MCPToolsEnvironment", (MCPEnvironment,), namespace)

    def close(self) -> None:
        """End the session and the server process; safe to call twice, from any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop has ended already: the session and the server went with it
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        self._stderr.close()

    def __enter__(self) -> "MCPServer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- on the event loop's thread -------------------------------------------------------------

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        """Hold the session from the handshake until close(); `ready` gets the tool list or the failure."""
        from mcp import ClientSession, StdioServerParameters, stdio_client

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        params = StdioServerParameters(command=self.command, args=self.args, env=self._env, cwd=self._cwd)
        try:
            async with stdio_client(params, errlog=self._stderr) as (read, write):
                async with ClientSession(read, write) as session:
                    tools = await asyncio.wait_for(_handshake(session), self.startup_timeout_s)
                    self._session = session
                    ready.set_result(tools)
                    await self._stop.wait()
        except BaseException as exc:  # whatever ends the session, the starter must learn of it
            if not ready.done():
                ready.set_exception(exc)
            # After the start, a failing session shows in the calls themselves: the loop just ends.

    async def _call_tool(self, name: str, arguments: dict) -> str:
        from mcp import MCPError

        try:
            result = await self._session.call_tool(name, arguments)
        except MCPError as exc:
            raise MCPToolError(f"MCP tool {name!r}: {exc}") from None
        text = _result_text(result)
        if result.is_error:
            raise MCPToolError(text or f"MCP tool {name!r} failed without a message")
        return text

    # -- helpers --------------------------------------------------------------------------------

    def _submit(self, coroutine: Any) -> concurrent.futures.Future:
        loop = self._loop
        if self._closed or loop is None or not self._thread.is_alive():
            coroutine.close()
            raise MCPToolError(f"MCP server `{self.command_line}` is not running{self._stderr_hint()}")
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, loop)
        except RuntimeError:  # the loop ended between the check and the call
            coroutine.close()
            raise MCPToolError(f"MCP server `{self.command_line}` is not running{self._stderr_hint()}") from None

    def _startup_cause(self, exc: BaseException) -> str:
        from mcp import MCPError

        exc = _first_leaf(exc)
        if isinstance(exc, (TimeoutError, concurrent.futures.TimeoutError)):
            cause = f"it did not answer `initialize` within {self.startup_timeout_s:g} s"
        elif isinstance(exc, MCPError):
            cause = f"it closed the connection before answering `initialize` ({exc})"
        else:
            cause = f"{type(exc).__name__}: {exc}"
        return cause + self._stderr_hint()

    def _stderr_hint(self) -> str:
        line = self._stderr_last_line()
        return f"; its stderr ends with: {line}" if line else ""

    def _stderr_last_line(self) -> str:
        try:
            size = os.fstat(self._stderr.fileno()).st_size
            tail = os.pread(self._stderr.fileno(), STDERR_TAIL_BYTES, max(0, size - STDERR_TAIL_BYTES))
        except (OSError, ValueError):  # ValueError: the file is closed
            return ""
        lines = [line.strip() for line in tail.decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines else ""


async def _handshake(session: Any) -> list:
    """Initialize the session and list every tool, following the listing's pages."""
    from mcp.types import PaginatedRequestParams

    await session.initialize()
    tools, cursor = [], None
    while True:
        listing = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools.extend(listing.tools)
        cursor = listing.next_cursor
        if not cursor:
            return tools


def _tool_schema(tool: Any) -> dict:
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description or "",
                         "parameters": tool.input_schema}}


def _result_text(result: Any) -> str:
    """A tool result as the tool message's text: its text items, a placeholder for anything else."""
    parts = [item.text if item.type == "text" else f"[{item.type} content]" for item in result.content]
    if not parts and result.structured_content is not None:  # a result given only as structured data
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real exception inside anyio's task-group wrapping (ExceptionGroup)."""
    while getattr(exc, "exceptions", None):  # duck-typed: BaseExceptionGroup is not built in before 3.11
        exc = exc.exceptions[0]
    return exc


def _tool_method(name: str, schema: dict) -> Any:
    def tool(self: MCPEnvironment, **arguments: Any) -> str:
        return self._server.call(name, arguments)

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = schema["function"]["description"]
    tool.json_schema = schema  # rcgrpo takes the schema from here instead of parsing a docstring
    return tool


def _reward_method(reward_tool: str) -> Any:
    def get_reward(self: MCPEnvironment) -> float:
        text = self._server.call(reward_tool, {})
        try:
            return float(text)
        except ValueError:
            raise MCPToolError(f"reward tool {reward_tool!r} returned {text[:200]!r}, not a number") from None

    return get_reward
