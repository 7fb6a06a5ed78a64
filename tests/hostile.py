"""Model replies meant to break the environment, shared by the security
tests, the degenerate-reply fuzz test and the soak benchmark."""
from __future__ import annotations

import sys

# Each would touch a file named {p} if anything ran it.
HOSTILE = [
    "__import__('os').system('touch {p}')",
    "ls(a=__import__('os').system('touch {p}'))",
    "open(file='{p}', mode='w')",
    "cd(folder=open('{p}', 'w'))",
    "mkdir(dir_name=(lambda: __import__('os').system('touch {p}'))())",
    "ls(a=[__import__('os').system('touch {p}') for _ in [0]])",
    "os.system('touch {p}')",
    "cd.__globals__['os'].system('touch {p}')",
    "exec(source=\"open('{p}','w')\")",
    "eval(\"open('{p}','w')\")",
    "mkdir(dir_name='{p}'.join(['a']))",
    "cd(folder=f\"{{__import__('os').system('touch {p}')}}\")",
    "mkdir(dir_name=print.__self__.__import__('os').system('touch {p}'))",
    "mkdir(**{{'dir_name': __import__('os').system('touch {p}')}})",
]


def wrap(kind: str, inner: str, n: int) -> str:
    """`inner` wrapped n times by one syntactic form (built iteratively)."""
    forms = {
        "call_nest": ("ls(a=" * n, ")" * n),
        "call_chain": ("", "()" * n),
        "attribute": ("", ".a" * n),
        "subscript": ("", "[0]" * n),
        "list": ("[" * n, "]" * n),
        "tuple": ("(" * n, ",)" * n),
        "dict": ("{'k': " * n, "}" * n),
        "paren": ("(" * n, ")" * n),
        "negate": ("-" * n, ""),
        "not": ("not " * n, ""),
        "add": ("", "+1" * n),
        "power": ("", "**2" * n),
        "compare": ("", "<1" * n),
        "lambda": ("lambda: " * n, ""),
        "ternary": ("1 if 1 else " * n, ""),
        "keyword_call": ("dict(x=" * n, ")" * n),
    }
    head, tail = forms[kind]
    return head + inner + tail


KINDS = ["call_nest", "call_chain", "attribute", "subscript", "list", "tuple", "dict", "paren", "negate", "not",
         "add", "power", "compare", "lambda", "ternary", "keyword_call"]


class AuditLog:
    """Python audit events that mean something ran that must not."""

    FORBIDDEN = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.remove", "os.rmdir",
                 "shutil.rmtree", "socket.connect", "ctypes.dlopen")

    def __init__(self, marker_dir=None):
        self.active = False
        self.seen: list[str] = []
        self.marker_dir = None if marker_dir is None else str(marker_dir)
        sys.addaudithook(self.hook)  # hooks cannot be removed; `active` gates this one

    def hook(self, event, args):
        if not self.active:
            return
        if event.startswith(self.FORBIDDEN):
            self.seen.append(f"{event} {args!r:.120}")
        elif event == "exec" and args and getattr(args[0], "co_filename", "").startswith("<"):
            # Module imports exec their own files; code made from text has "<string>".
            self.seen.append(f"exec of code from text: {args[0].co_filename}")
        elif event == "subprocess.Popen" and "rcgrpo.envs.bounded_worker" not in " ".join(map(str, args[1] or [])):
            self.seen.append(f"subprocess {args!r:.120}")
        elif event == "open" and args and self.marker_dir is not None and self.marker_dir in str(args[0]):
            self.seen.append(f"open {args[0]}")


def shared_tree(levels: int, calls_per_reply: int = 50) -> list[str]:
    """Replies that build, with 7 cheap calls per level, a GorillaFileSystem
    tree holding 2**levels paths: `cp` copies a directory's entries, not the
    directories under them, so `x` and its copy `y` share the sub-directory
    `z`, inside which the next level is made."""
    calls = ["mkdir(dir_name='amp')", "cd(folder='amp')"]
    for _ in range(levels):
        calls += ["mkdir(dir_name='x')", "cd(folder='x')", "mkdir(dir_name='z')", "cd(folder='..')",
                  "cp(source='x', destination='y')", "cd(folder='x')", "cd(folder='z')"]
    return ["[" + ", ".join(calls[i:i + calls_per_reply]) + "]" for i in range(0, len(calls), calls_per_reply)]


# Over a shared tree: all of its paths as text (memory), or a walk of it that
# matches nothing (time only).
LIST_EVERY_PATH = "[find(path='/')]"
WALK_EVERY_PATH = "[find(path='/', name='rcgrpo-no-such-name')]"
