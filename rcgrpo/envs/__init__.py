"""Environments: BFCL v4 multi-turn (data, split, episodes, reward, official
verdict) and any environment in TRL's contract (tool_env: an
environment_factory, tools and reward functions; tool_calls: how calls are
written and read; tools: bounded calls of user code; tasks: rows from data;
mcp_tools / openenv_tools: adapters; shipped: the environments rcgrpo ships).
Both kinds are played through one episode protocol (episode)."""
from rcgrpo.envs import _bfcl  # noqa: F401  (before any module of this package imports bfcl_eval)
