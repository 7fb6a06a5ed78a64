"""rcgrpo: RC-GRPO for multi-turn tool calling (README.md, "Layout", names
each package's job and the order in which they may import each other)."""
from rcgrpo import moved as _moved

_moved.install()  # old module paths keep importing for one release (rcgrpo/moved.py)
