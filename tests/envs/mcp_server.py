"""A small, real MCP server for tests/envs/test_mcp_tools.py, run over stdio.

`python tests/envs/mcp_server.py` serves these tools with the MCP SDK's own
server (`MCPServer`, called `FastMCP` before mcp 2), so the adapter in
rcgrpo/envs/mcp_tools.py is tested against the protocol as the SDK speaks it,
not against a stand-in. Each tool covers one case of the adapter: a plain
result (`add`), state kept in the server between calls (`counter_*`), a tool
that raises (`fail`), one that outlasts the caller's time limit (`sleep`), a
reward (`score`), and the process id (`pid`) so that a test can see the
server process end.
"""
from __future__ import annotations

import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("rcgrpo-test-server")
_counter = 0


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def counter_increment() -> int:
    """Add one to the counter and return its new value."""
    global _counter
    _counter += 1
    return _counter


@server.tool()
def counter_value() -> int:
    """The counter's current value."""
    return _counter


@server.tool()
def fail(message: str) -> str:
    """Fail with `message`."""
    # ToolError, not any exception: mcp 2 sends the text of a ToolError to the
    # client and withholds that of an unexpected exception (a crash).
    raise ToolError(message)


@server.tool()
async def sleep(seconds: float) -> str:
    """Wait `seconds`, then answer. Asynchronous, so the server keeps answering other calls meanwhile."""
    await anyio.sleep(seconds)
    return "slept"


@server.tool()
def score() -> float:
    """The reward: a tenth of the counter."""
    return _counter / 10


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


if __name__ == "__main__":
    server.run("stdio")
