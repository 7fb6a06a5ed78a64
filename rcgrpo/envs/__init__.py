"""BFCL v4 multi-turn environment: data, split, episodes, reward, verdict."""
from rcgrpo.envs import _bfcl  # noqa: F401  (before any module of this package imports bfcl_eval)
