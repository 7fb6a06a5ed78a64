"""State a tool call can set outside its episode (mpmath's precision, the
decimal context) never reaches the next call or the trainer's process, and
what runs out of process (MathAPI, the official checker) is bounded in time
and memory."""
import decimal
import os
import subprocess
import sys
import time
from pathlib import Path

import mpmath
import pytest

from rcgrpo.envs.bfcl import Episode
from rcgrpo.envs.bounded_worker import MEMORY_LIMIT_BYTES, BoundedWorker, WorkerOutcome
from rcgrpo.envs.executor import _bounded_call_outcome

JOBS = "tests.envs.worker_jobs"


@pytest.fixture
def math_entry(entries):
    return next(e for e in entries if "MathAPI" in e.involved_classes)


def test_a_checked_call_leaves_this_process_at_its_precision(math_entry):
    # The official checker runs the model's calls again; it once did so in
    # this process and left mpmath at 10^8 digits for every later episode.
    dps, prec = mpmath.mp.dps, decimal.getcontext().prec
    episode = Episode(math_entry)
    step = episode.step("[logarithm(value=1, base=0, precision=100000000), square_root(number=2, precision=500)]")
    assert all(m["content"].startswith("{") for m in step.tool_messages), step.tool_messages
    while not episode.done:  # every turn answered, so the checker runs the calls again
        episode.end_turn()
    assert "force_terminated" not in (episode.result().verdict_error or "")
    assert (mpmath.mp.dps, decimal.getcontext().prec) == (dps, prec)


def test_tool_text_is_printed_at_the_calls_own_precision(math_entry):
    # As the official runner shows it: str() of the result while the call's
    # precision holds (33 digits here), not the trainer's 15.
    episode = Episode(math_entry)
    (message,) = episode.step("[logarithm(value=2, base=10, precision=33)]").tool_messages
    with mpmath.workdps(33):
        expected = str({"result": mpmath.log(2) / mpmath.log(10)})
    assert message["content"] == expected
    # and the next call, which sets no precision, is back at the default
    (after,) = Episode(math_entry).step("[logarithm(value=2, base=10, precision=15)]").tool_messages
    with mpmath.workdps(15):
        assert after["content"] == str({"result": mpmath.log(2) / mpmath.log(10)})


def test_the_worker_puts_numeric_state_back_after_each_request():
    worker = BoundedWorker()
    try:
        pristine = worker.run(JOBS, "precision", {}, 30).detail
        assert worker.run(JOBS, "set_precision", {"dps": 5000, "prec": 7}, 30).detail == (5000, 7)
        assert worker.run(JOBS, "precision", {}, 30).detail == pristine
    finally:
        worker.kill()


def test_the_worker_is_bounded_in_memory_and_time():
    worker = BoundedWorker()
    try:
        over = worker.run(JOBS, "allocate", {"n_bytes": MEMORY_LIMIT_BYTES + (1 << 30)}, 60)
        assert over.kind == WorkerOutcome.EXHAUSTED, over
        assert worker.run(JOBS, "allocate", {"n_bytes": 1 << 20}, 60).detail == 1 << 20  # a fresh worker
        assert worker.run(JOBS, "sleep", {"seconds": 30}, 0.5).kind == WorkerOutcome.TIMED_OUT
        assert worker.run(JOBS, "sleep", {"seconds": 0}, 30).detail == "woke"
    finally:
        worker.kill()


def test_a_call_stopped_by_a_bound_did_not_run():
    # Not run: the official checker gets the placeholder instead of running
    # the call again in its own worker; and it covers nothing.
    for outcome in (WorkerOutcome(WorkerOutcome.EXHAUSTED, "out of memory (3 GiB bound)"),
                    WorkerOutcome(WorkerOutcome.TIMED_OUT)):
        call = _bounded_call_outcome(outcome, 5.0)
        assert call.text.startswith("Error during execution:") and not call.ran and not call.succeeded


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie waiting for a parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


INTERRUPTED_DURING_A_CALL = """
import os, signal, sys, threading
from rcgrpo.envs.bounded_worker import BoundedWorker
from rcgrpo.base.errors import run_command

# Ctrl-C raises KeyboardInterrupt, as at a terminal, even when this test runs
# under a shell's background job (which starts it with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)

def body(argv):
    worker = BoundedWorker.shared("stateless_calls")
    worker.run("tests.envs.worker_jobs", "sleep", {"seconds": 0}, 60)  # started
    print(worker._proc.pid, flush=True)
    threading.Timer(1.0, lambda: os.killpg(os.getpgrp(), signal.SIGINT)).start()  # Ctrl-C at the terminal
    worker.run("tests.envs.worker_jobs", "sleep", {"seconds": 60}, 120)
    return 0

sys.exit(run_command("rcgrpo.train", body, []))
"""


def test_ctrl_c_during_a_worker_call_is_one_line_and_leaves_no_worker():
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_DURING_A_CALL], capture_output=True, text=True,
                          start_new_session=True, timeout=120, env={**os.environ, "RCGRPO_DEBUG": "0"})
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["rcgrpo.train: interrupted"], proc.stderr
    worker_pid = int(proc.stdout.split()[0])
    time.sleep(0.5)
    assert gone(worker_pid)


def test_a_killed_trainer_leaves_no_worker_computing():
    script = ("import time\nfrom rcgrpo.envs.bounded_worker import BoundedWorker\n"
              "w = BoundedWorker.shared('stateless_calls')\n"
              "w.run('tests.envs.worker_jobs', 'sleep', {'seconds': 0}, 60)\n"
              "print(w._proc.pid, flush=True)\n"
              "w.run('tests.envs.worker_jobs', 'sleep', {'seconds': 600}, 900)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker_pid = int(proc.stdout.readline())
    proc.kill()  # SIGKILL: no clean-up of its own runs
    proc.wait()
    for _ in range(50):
        if gone(worker_pid):
            break
        time.sleep(0.1)
    assert gone(worker_pid)
