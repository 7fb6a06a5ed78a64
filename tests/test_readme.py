"""The README's code blocks marked `<!-- readme-test: runs on CPU ... -->` run
as written, so they cannot drift from the code. A python block runs in a
fresh interpreter, a bash block in bash -e from the repository's root with
this interpreter's folder first on PATH (so `python` is the project's)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- readme-test: runs on CPU"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def marked_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line, language, code) of each block whose fence follows the marker line."""
    found = []
    for m in BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.startswith(MARK):
            found.append((text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)))
    return found


README = (ROOT / "README.md").read_text()
BLOCKS = marked_blocks(README)


def _marker(line: int) -> str:
    return README.splitlines()[line - 2]


# A block whose marker says "slow" runs in `make test`, not in `make test-fast`: one that trains, and
# every one that starts Python (a fresh interpreter imports torch: 2-4 s a block on 2 cores).
PARAMS = [pytest.param(line, lang, code, id=f"README.md:{line}",
                       marks=[pytest.mark.slow] if "slow" in _marker(line) else [])
          for line, lang, code in BLOCKS]


def test_the_marked_blocks_are_found():
    # The marker must keep naming real blocks: a renamed marker would leave nothing to run.
    assert len(BLOCKS) >= 2 and {lang for _, lang, _ in BLOCKS} <= {"python", "bash"}
    assert marked_blocks(f"{MARK} -->\n```python\nx = 1\n```\n```bash\nno\n```\n") == [(2, "python", "x = 1\n")]


@pytest.mark.parametrize("line,lang,code", PARAMS)
def test_readme_block_runs(line, lang, code, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-e", "-c", code]
    out = subprocess.run(argv, cwd=ROOT if lang == "bash" else tmp_path, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, f"README.md:{line} ({lang}) exited {out.returncode}:\n{out.stderr[-3000:]}"
