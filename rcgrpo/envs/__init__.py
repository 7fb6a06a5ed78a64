"""BFCL v4 multi-turn environment: data, split, episodes, reward, verdict."""
from rcgrpo.envs import _bfcl  # noqa: F401  (before anything imports bfcl_eval)
