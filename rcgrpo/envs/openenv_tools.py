"""An OpenEnv environment server as a TRL-style environment (`environment_factory`).

OpenEnv (PyPI `openenv-core`, module `openenv`) serves Gym-style environments
over HTTP and a WebSocket (`/ws`: one session, i.e. one environment instance,
per connection); Unsloth and TRL users train on such servers. This module
turns one into what TRL's `GRPOTrainer` takes as `environment_factory`, using
OpenEnv's own clients, so a run trains on an OpenEnv server without glue:

    factory = openenv_environment_factory("http://127.0.0.1:8000")
    trainer = GRPOTrainer(..., environment_factory=factory)

Two kinds of server, told apart by the action schema (`GET /schema`):

- MCP environments (action `CallToolAction`: `tool_name` + `arguments`): one
  tool per MCP tool the environment lists, with the tool's own input schema;
  calls go through `MCPToolClient` over `/ws`, so each is an env `step` and
  carries the env's reward and `done`.
- Plain action environments: one tool whose parameters are the action's
  fields (OpenEnv's base `metadata` field left out), sent with
  `GenericEnvClient`; the tool is named after the action class (`GuessAction`
  -> `guess`) unless `action_tool` says otherwise.

Per instance: `reset(**row)` opens the instance's WebSocket session on first
use and resets the env with the row's columns named in `reset_keys` (default
`seed` and `episode_id`, which OpenEnv's `reset` takes; the server drops keys
its env's `reset` does not accept) and returns the first observation as text.
`get_reward()` is the sum of every reward the env returned in the episode,
the reset's included (`reward="sum"`, None counting 0), or the last one
given (`reward="last"`). A tool call after the env said `done`, an argument
the schema does not have, a validation error or an MCP tool error raises
`OpenEnvToolError`, which TRL shows the model as the call's error.

The class is built at run time (TRL finds tools with `inspect.isfunction` on
the class), one plain function per tool. Each carries its exact schema as
`json_schema` (what rcgrpo reads) and also a signature, annotations and a
Google-style docstring from which `transformers.utils.get_json_schema` makes
the same schema (what TRL's chat template path reads); a parameter whose name
is no Python identifier gets no signature, so only `json_schema` serves then.

OpenEnv's clients are asynchronous: one event loop on a daemon thread, shared
by every instance, holds all sessions, and each synchronous call is sent to it
with a hard time limit (`connect_timeout_s` to connect, `message_timeout_s`
per message, plus a small margin); a call past it drops that session, so a
late answer cannot be taken for the next one. A server that cannot be reached
raises a one-line `UserError` naming the URL. The server must allow as many
concurrent sessions as TRL keeps instances (`max_concurrent_envs`, default 1).
Importing `openenv` takes a few seconds (it loads gradio), so it is imported
only when a factory is made.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import ipaddress
import json
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
import weakref
from typing import Any, Callable, Literal, Optional, Sequence

from rcgrpo.base.errors import UserError, one_line

__all__ = ["OpenEnvToolError", "OpenEnvEnvironment", "OpenEnvFactory", "openenv_environment_factory"]

# The environment contract's own methods: no tool may take these names.
RESERVED_NAMES = ("reset", "get_reward")
# On top of the client's own timeouts, so that they fire first and give their clearer message.
MARGIN_S = 2.0
# JSON schema types -> the Python annotations that make get_json_schema give them back.
_PY_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


class OpenEnvToolError(RuntimeError):
    """A step the env refused (bad arguments, a failed MCP tool, an episode already over); the text says why."""


# One event loop for every session: connections stay bound to the loop that opened them.
_loop_lock = threading.Lock()
_loop: Optional[asyncio.AbstractEventLoop] = None


def _shared_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or not _loop.is_running():
            loop = asyncio.new_event_loop()
            started = threading.Event()
            loop.call_soon(started.set)
            threading.Thread(target=loop.run_forever, name="openenv-clients", daemon=True).start()
            started.wait()
            _loop = loop
        return _loop


def _run(coro: Any, limit_s: float) -> Any:
    """Run `coro` on the shared loop; past `limit_s` cancel it and raise TimeoutError."""
    future = asyncio.run_coroutine_threadsafe(coro, _shared_loop())
    try:
        return future.result(timeout=limit_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no answer within {limit_s:g} s") from None


def _http_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    for ws, http in (("ws://", "http://"), ("wss://", "https://")):
        if url.startswith(ws):
            return http + url[len(ws):]
    return url


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _get_json(url: str, timeout_s: float) -> Any:
    # A proxy set for the outside world must not catch a server on this machine.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({})) if _is_loopback(url) else \
        urllib.request.build_opener()
    with opener.open(url, timeout=timeout_s) as response:
        return json.loads(response.read().decode("utf-8"))


def _observation_text(observation: Any) -> Optional[str]:
    """An observation dict as text: a lone string field as it is, anything else as compact JSON."""
    if observation is None or observation == {}:
        return None
    if isinstance(observation, str):
        return observation
    if isinstance(observation, dict) and len(observation) == 1:
        (value,) = observation.values()
        if isinstance(value, str):
            return value
    return json.dumps(observation, ensure_ascii=False, default=str)


def _mcp_result_text(result: Any) -> str:
    """An MCP tool result (serialized `CallToolResult`) as text: its text items, or its data as JSON."""
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        parts = [item.get("text", "") if item.get("type") == "text" else f"[{item.get('type')} content]"
                 for item in result["content"] if isinstance(item, dict)]
        if result.get("is_error") or result.get("isError"):
            raise OpenEnvToolError("\n".join(parts) or "the tool failed")
        if parts:
            return "\n".join(parts)
        result = result.get("structured_content", result.get("data"))
    return _observation_text(result) or ""


def _snake(name: str) -> str:
    name = re.sub(r"Action$", "", name) or name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _tool_function(name: str, schema: dict, call: Callable[["OpenEnvEnvironment", str, dict], str]) -> Any:
    """A plain function for one tool: `json_schema` exact, signature and docstring for get_json_schema."""
    params = schema["function"]["parameters"]
    properties = params.get("properties") or {}
    required = set(params.get("required") or ())

    def tool(self: OpenEnvEnvironment, **arguments: Any) -> str:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            raise OpenEnvToolError(f"{name}: no argument(s) {', '.join(unknown)}; it takes {sorted(properties)}")
        missing = sorted(required - set(arguments))
        if missing:
            raise OpenEnvToolError(f"{name}: missing argument(s) {', '.join(missing)}")
        return call(self, name, arguments)

    tool.__name__ = tool.__qualname__ = name
    tool.json_schema = schema  # rcgrpo takes the schema from here instead of parsing a docstring
    description = " ".join((schema["function"].get("description") or name).split())
    if all(p.isidentifier() for p in properties):
        # Optional parameters default to None in the signature only: get_json_schema reads "required" from it.
        sig_params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        annotations: dict[str, Any] = {"return": str}
        args_doc = []
        for pname, prop in sorted(properties.items(), key=lambda kv: kv[0] not in required):
            annotation = _PY_TYPES.get(prop.get("type") if isinstance(prop, dict) else None, Any)
            default = inspect.Parameter.empty if pname in required else None
            sig_params.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=default,
                                                annotation=annotation))
            annotations[pname] = annotation
            text = " ".join(str((prop or {}).get("description") or (prop or {}).get("title") or pname).split())
            args_doc.append(f"    {pname}: {text}")
        tool.__signature__ = inspect.Signature(sig_params, return_annotation=str)
        tool.__annotations__ = annotations
        tool.__doc__ = description + ("\n\nArgs:\n" + "\n".join(args_doc) if args_doc else "")
    else:
        tool.__doc__ = description
    return tool


class OpenEnvEnvironment:
    """Base of the classes `OpenEnvFactory` builds; its subclasses add one method per tool.

    Only `reset` and `get_reward` are public functions here: TRL takes every
    other public function of the class for a tool.
    """

    _factory: "OpenEnvFactory"

    def __init__(self) -> None:
        self._client: Any = None  # OpenEnv's async client, opened on the first reset
        self._rewards: list[float] = []
        self._done = False

    @property
    def done(self) -> bool:
        """Whether the env has ended the episode."""
        return self._done

    def reset(self, **row: Any) -> Optional[str]:
        """Start an episode with the row's `reset_keys` columns; the env's first observation as text."""
        factory = self._factory
        kwargs = {key: row[key] for key in factory.reset_keys if key in row and row[key] is not None}
        try:
            json.dumps(kwargs)
        except (TypeError, ValueError) as exc:
            raise UserError(f"OpenEnv reset arguments {sorted(kwargs)} are not JSON: {exc}") from None
        reused = self._client is not None
        if not reused:
            self._connect()
        try:
            result = self._exchange(self._client.reset(**kwargs), "reset")
        except OpenEnvToolError:
            if not reused or self._client is not None:
                raise  # a fresh session failed, or the env refused the reset itself
            # A session kept from the last episode can be gone (server restart, idle-session reaper): one new one.
            self._connect()
            result = self._exchange(self._client.reset(**kwargs), "reset")
        self._rewards = []
        self._done = False
        self._record(result)
        return factory._render_reset(result.observation)

    def _connect(self) -> None:
        factory = self._factory
        self._client = factory._new_client()
        factory._instances.add(self)
        try:
            _run(self._client.connect(), factory.connect_timeout_s + MARGIN_S)
        except (ConnectionError, OSError, TimeoutError) as exc:
            self._client = None
            raise UserError(one_line(f"OpenEnv server at {factory.base_url} cannot be reached: {exc}")) from None

    def get_reward(self) -> float:
        """The episode's reward: the sum of the env's rewards, or the last one (`reward="last"`)."""
        if not self._rewards:
            return 0.0
        return float(self._rewards[-1] if self._factory.reward == "last" else sum(self._rewards))

    def _record(self, result: Any) -> None:
        if result.reward is not None:
            self._rewards.append(float(result.reward))
        self._done = bool(result.done)

    def _exchange(self, coro: Any, what: str) -> Any:
        """One request on this instance's session; a session that timed out or broke is dropped."""
        factory = self._factory
        try:
            return _run(coro, factory.connect_timeout_s + factory.message_timeout_s + MARGIN_S)
        except RuntimeError as exc:
            message = str(exc)
            if "CAPACITY_REACHED" in message:
                self._drop()
                raise UserError(one_line(f"OpenEnv server at {factory.base_url} has no free session ({message}); "
                                         f"start it with a larger max_concurrent_envs")) from None
            if message.startswith("Server error:"):  # the session lives on; the env refused this message
                raise OpenEnvToolError(f"{what}: {message}") from None
            self._drop()
            raise
        except (TimeoutError, ConnectionError, OSError, asyncio.CancelledError) as exc:
            self._drop()
            raise OpenEnvToolError(one_line(f"{what}: OpenEnv server at {factory.base_url} failed: "
                                            f"{type(exc).__name__}: {exc}")) from None
        except Exception as exc:  # websockets' ConnectionClosed and the like: the session is gone
            self._drop()
            raise OpenEnvToolError(one_line(f"{what}: OpenEnv session lost: {type(exc).__name__}: {exc}")) from None

    def _step(self, action: Any, what: str) -> Any:
        if self._client is None:
            raise OpenEnvToolError(f"{what}: no episode is running (reset was not called or its session was lost)")
        if self._done:
            raise OpenEnvToolError(f"{what}: the episode is over")
        result = self._exchange(self._client.step(action), what)
        self._record(result)
        return result

    def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                _run(client.close(), self._factory.connect_timeout_s + MARGIN_S)
            except Exception:  # noqa: BLE001 - closing a broken session is best effort
                pass

    def _close(self) -> None:
        self._drop()
        self._factory._instances.discard(self)


def _mcp_call(self: OpenEnvEnvironment, name: str, arguments: dict) -> str:
    from openenv.core.env_server.mcp_types import CallToolAction

    observation = self._step(CallToolAction(tool_name=name, arguments=arguments), name).observation
    if getattr(observation, "error", None) is not None:
        raise OpenEnvToolError(f"{name}: {observation.error.message}")
    return _mcp_result_text(getattr(observation, "result", None))


def _action_call(self: OpenEnvEnvironment, name: str, arguments: dict) -> str:
    observation = self._step(dict(arguments), name).observation
    return self._factory.render_observation(observation) or ""


class OpenEnvFactory:
    """`environment_factory` for one OpenEnv server: call it for a new environment instance.

    Made by `openenv_environment_factory`; `tools` lists the schemas, `kind` is
    "mcp" or "action", `close()` ends every session its instances opened.
    """

    def __init__(self, base_url: str, *, kind: Literal["auto", "mcp", "action"] = "auto",
                 reset_keys: Sequence[str] = ("seed", "episode_id"), reward: Literal["sum", "last"] = "sum",
                 action_tool: Optional[str] = None, class_name: str = "OpenEnvEnvironment",
                 render_observation: Optional[Callable[[Any], Optional[str]]] = None,
                 connect_timeout_s: float = 5.0, message_timeout_s: float = 30.0):
        if kind not in ("auto", "mcp", "action"):
            raise UserError(f"OpenEnv kind must be auto, mcp or action, not {kind!r}")
        if reward not in ("sum", "last"):
            raise UserError(f"OpenEnv reward must be sum or last, not {reward!r}")
        self.base_url = _http_url(base_url)
        self.reset_keys = tuple(reset_keys)
        self.reward = reward
        self.render_observation = render_observation or _observation_text
        self.connect_timeout_s = connect_timeout_s
        self.message_timeout_s = message_timeout_s
        self._instances: "weakref.WeakSet[OpenEnvEnvironment]" = weakref.WeakSet()
        try:
            schemas = _get_json(f"{self.base_url}/schema", connect_timeout_s + message_timeout_s)
            action_schema = schemas["action"]
        except (urllib.error.URLError, OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise UserError(one_line(f"OpenEnv server at {self.base_url} cannot be reached "
                                     f"(GET /schema): {reason}")) from None
        properties = action_schema.get("properties") or {}
        is_mcp = "tool_name" in properties and "arguments" in properties
        self.kind = ("mcp" if is_mcp else "action") if kind == "auto" else kind
        if self.kind == "mcp":
            schemas_by_name, call = self._mcp_tools(), _mcp_call
        else:
            schemas_by_name, call = self._action_tool(action_schema, action_tool), _action_call
        for name in schemas_by_name:
            if name in RESERVED_NAMES or name.startswith("_") or not name:
                raise UserError(f"OpenEnv server at {self.base_url}: a tool cannot be named {name!r} "
                                f"(reserved: {', '.join(RESERVED_NAMES)}, or leading '_')")
        namespace: dict[str, Any] = {"_factory": self}
        for name, schema in schemas_by_name.items():
            namespace[name] = _tool_function(name, schema, call)
        self.tools = list(schemas_by_name.values())
        self.environment_class = type(class_name, (OpenEnvEnvironment,), namespace)

    def __call__(self) -> OpenEnvEnvironment:
        return self.environment_class()

    def close(self) -> None:
        """End the sessions of every instance made so far (best effort, bounded)."""
        for instance in list(self._instances):
            instance._close()

    def _new_client(self) -> Any:
        if self.kind == "mcp":
            from openenv.core.mcp_client import MCPToolClient

            # Simulation transport (/ws): every call is an env step and carries its reward.
            return MCPToolClient(self.base_url, connect_timeout_s=self.connect_timeout_s,
                                 message_timeout_s=self.message_timeout_s)
        from openenv.core.generic_client import GenericEnvClient

        return GenericEnvClient(self.base_url, connect_timeout_s=self.connect_timeout_s,
                                message_timeout_s=self.message_timeout_s)

    def _render_reset(self, observation: Any) -> Optional[str]:
        if self.kind == "mcp":  # MCPToolClient parses into pydantic observations
            result = getattr(observation, "result", None)
            if result is not None:
                return _mcp_result_text(result)
            dumped = observation.model_dump(exclude={"reward", "done", "metadata", "tool_name", "error"})
            return self.render_observation({k: v for k, v in dumped.items() if v is not None})
        return self.render_observation(observation)

    def _mcp_tools(self) -> dict[str, dict]:
        """List the env's MCP tools on a short-lived session of its own."""
        client = self._new_client()
        limit = self.connect_timeout_s + self.message_timeout_s + MARGIN_S

        async def list_tools() -> Any:
            try:
                await client.connect()
                return await client.list_tools(use_cache=False)
            finally:
                await client.close()

        try:
            tools = _run(list_tools(), limit)
        except (ConnectionError, OSError, TimeoutError, RuntimeError) as exc:
            raise UserError(one_line(f"OpenEnv server at {self.base_url} cannot be reached "
                                     f"(listing MCP tools): {exc}")) from None
        if not tools:
            raise UserError(f"OpenEnv server at {self.base_url} lists no MCP tools")
        return {tool.name: {"type": "function", "function": {
            "name": tool.name, "description": tool.description or tool.name,
            "parameters": tool.input_schema or {"type": "object", "properties": {}}}} for tool in tools}

    def _action_tool(self, action_schema: dict, name: Optional[str]) -> dict[str, dict]:
        """The one tool of a plain env: the action's fields, OpenEnv's own `metadata` left out."""
        title = action_schema.get("title") or "Action"
        name = name or _snake(title)
        if not name.isidentifier() or name in RESERVED_NAMES:
            name = "step"
        properties = {k: v for k, v in (action_schema.get("properties") or {}).items() if k != "metadata"}
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        required = [k for k in action_schema.get("required") or () if k in properties]
        if required:
            parameters["required"] = required
        if "$defs" in action_schema:  # nested models: their references point here
            parameters["$defs"] = action_schema["$defs"]
        description = action_schema.get("description") or f"Take one action ({title}) in the environment."
        return {name: {"type": "function", "function": {
            "name": name, "description": description, "parameters": parameters}}}


def openenv_environment_factory(base_url: str, **options: Any) -> OpenEnvFactory:
    """The TRL `environment_factory` of the OpenEnv server at `base_url` (see `OpenEnvFactory` for options).

    Reads the server's schema (and MCP tool list) now, so a server that cannot
    be reached fails here, in one line, before training starts.
    """
    return OpenEnvFactory(base_url, **options)
