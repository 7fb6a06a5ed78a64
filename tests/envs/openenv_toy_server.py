"""Two tiny OpenEnv environments served on loopback, for tests/envs/test_openenv_tools.py.

Run as a script (`python tests/envs/openenv_toy_server.py`): it binds 127.0.0.1 on a
port the OS picks, prints `PORT <n>` once listening and serves until killed. Both
environments are built only from openenv-core's own server classes (`Environment`,
`MCPEnvironment`, `create_fastapi_app`) so the adapter is tested against the real
WebSocket protocol, not a mock of it:

- `/guess`: a plain action environment. `reset(seed, target)` hides a number in
  1..10; the action is `{"guess": int}`; reward 1.0 and done when it is found.
- `/tools`: an MCP environment with two tools, `add(a, b)` and `submit(answer)`;
  `submit` ends the episode with reward 1.0 when the answer equals the hidden sum.
"""
from __future__ import annotations

import random
import socket
import sys
from typing import Any, Optional
from uuid import uuid4

from fastapi import FastAPI
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

SESSIONS = 8  # the tests open a few clients at once; OpenEnv's default is 1


class GuessAction(Action):
    guess: int = Field(..., description="The number to try, between 1 and 10.")


class GuessObservation(Observation):
    message: str = Field(default="", description="What the environment says.")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._target = 1

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              target: Optional[int] = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._target = int(target) if target is not None else random.Random(seed).randint(1, 10)
        return GuessObservation(message="I picked a number between 1 and 10.", reward=0.0)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self._target:
            return GuessObservation(message="Correct!", reward=1.0, done=True)
        hint = "higher" if action.guess < self._target else "lower"
        return GuessObservation(message=f"No, go {hint}.", reward=-0.1)

    @property
    def state(self) -> State:
        return self._state


class SumToolsEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("sum-tools")
        self._pair = (0, 0)
        self._solved = False

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first addend.
                b: The second addend.
            """
            return a + b

        @mcp.tool
        def submit(answer: int) -> str:
            """Submit the final answer; this ends the episode.

            Args:
                answer: The sum of the two numbers in the task.
            """
            self._solved = answer == sum(self._pair)
            return "right" if self._solved else "wrong"

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> Observation:
        rng = random.Random(seed)
        self._pair = (rng.randint(10, 99), rng.randint(10, 99))
        self._solved = False
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return CallToolObservation(tool_name="reset", result=f"Add {self._pair[0]} and {self._pair[1]}.",
                                   reward=0.0)

    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        # MCP tool calls carry no reward by themselves; the environment scores `submit` here.
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit" and obs.error is None:
            obs.reward = 1.0 if self._solved else 0.0
            obs.done = True
        return obs

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unsupported action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


def build_app() -> FastAPI:
    app = FastAPI()
    app.mount("/guess", create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, SESSIONS))
    app.mount("/tools", create_fastapi_app(SumToolsEnvironment, CallToolAction, CallToolObservation, SESSIONS))
    return app


def main() -> None:
    import uvicorn

    # Bind first so the port is known before serving: no window in which another process could take it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(), log_level="warning"))
    original_startup = server.startup

    async def startup(sockets=None):
        await original_startup(sockets=sockets)
        print(f"PORT {sock.getsockname()[1]}", flush=True)

    server.startup = startup
    server.run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
