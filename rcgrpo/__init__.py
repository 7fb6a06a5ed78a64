"""rcgrpo: RC-GRPO for multi-turn tool calling (README.md, "Layout", names
each package's job and the order in which they may import each other)."""
from rcgrpo import moved as _moved

_moved.install()  # old module paths keep importing for one release (rcgrpo/moved.py)


# The Python trainer (rcgrpo/trainer.py), imported on first use: `import rcgrpo`
# stays light (no torch) for the tools that only read configs and reports.
_TRAINER_NAMES = ("RCGRPOTrainer", "RCGRPOConfig")
__all__ = list(_TRAINER_NAMES)


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        from rcgrpo import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'rcgrpo' has no attribute {name!r}")
