"""A rank that raises ends the whole job, non-zero, in bounded time, with the
rank and the error named; peers blocked in a collective do not hang."""

import pytest

from tests.distributed.conftest import torchrun

pytestmark = pytest.mark.slow  # torchrun jobs that must fail in bounded time (~5 s, ~3 s)

# Rank 1 raises while rank 0 waits in an all-reduce that rank 1 never joins.
SCRIPT = """
import sys, time, torch
from rcgrpo.base import distributed
with distributed.guarded():
    distributed.init("cpu", timeout_s=float(sys.argv[1]))
    if distributed.rank() == 1:
        raise ValueError("injected failure on purpose")
    distributed.all_reduce_sum({"x": 1.0})
    time.sleep(600)  # never reached: the collective fails or the agent stops us
"""


def test_torchrun_stops_the_job_when_a_rank_raises(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    # A collective timeout of a day: the job can only end because the agent stopped it.
    out = torchrun(2, [str(script), "86400"])
    assert out.returncode != 0
    assert "rank 1 of 2 failed: ValueError: injected failure on purpose" in out.stderr


def test_collective_timeout_bounds_the_wait_without_an_agent(tmp_path):
    """No torchrun agent to stop it: rank 0's all-reduce fails (its peer is gone, or
    at the latest the collective timeout) and it exits too."""
    import os
    import subprocess
    import sys

    from tests.distributed.conftest import ROOT, env

    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    procs = []
    for rank in (0, 1):
        e = dict(env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(29_500 + os.getpid() % 2000))
        procs.append(subprocess.Popen([sys.executable, str(script), "10"], env=e, cwd=ROOT,
                                      stderr=subprocess.PIPE, text=True))
    errs = [p.communicate()[1] for p in procs]
    assert [p.returncode != 0 for p in procs] == [True, True]
    assert "rank 1 of 2 failed: ValueError" in errs[1]
    assert "rank 0 of 2 failed" in errs[0]  # its all-reduce gave up instead of hanging
