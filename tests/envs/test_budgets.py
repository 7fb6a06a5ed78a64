"""What one reply and one episode may make the environment do: calls per
reply, tool text per call and per episode, environment time per episode,
memory per call; and the bounds on a call hold from any thread without
touching the caller's timers."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rcgrpo.envs.bfcl import Episode, EpisodeBudget
from rcgrpo.envs.bounded_thread import CALL_MEMORY_BUDGET_BYTES, BoundedThread
from rcgrpo.envs.bounded_worker import WorkerOutcome
from rcgrpo.envs.budget import (
    ENV_TIME_LIMIT,
    MAX_CALLS_PER_REPLY,
    MAX_EPISODE_TOOL_TEXT_CHARS,
    MAX_TOOL_TEXT_CHARS,
)
from rcgrpo.envs.reward import NOT_EXECUTED_PLACEHOLDER, ground_truth
from tests.hostile import LIST_EVERY_PATH, WALK_EVERY_PATH, shared_tree

FILE_SYSTEM_ENTRY = "multi_turn_base_0"


def built_tree(entry, levels: int, **episode_args) -> Episode:
    episode = Episode(entry, **episode_args)
    for reply in shared_tree(levels):
        step = episode.step(reply)
        assert not step.turn_ended and all(not m["content"].startswith("Error") for m in step.tool_messages)
    return episode


@pytest.mark.slow  # every entry's ground truth played (~5 s)
def test_bounds_sit_above_every_ground_truth(entries):
    # None of the bounds may change what a ground-truth trajectory sees.
    most_calls = most_text = most_episode_text = 0
    for entry in entries:
        episode = Episode(entry)
        spent = 0
        for turn in ground_truth(entry).calls:
            most_calls = max(most_calls, len(turn))
            if turn:
                for message in episode.step_calls(list(turn)).tool_messages:
                    assert "more characters cut" not in message["content"]
                    most_text = max(most_text, len(message["content"]))
                    spent += len(message["content"])
            episode.end_turn()
        most_episode_text = max(most_episode_text, spent)
        assert episode.budget.seconds_left > 0
    print(f"ground truth: {most_calls} calls in a turn, {most_text} characters in a tool result, "
          f"{most_episode_text} in an episode")
    assert most_calls < MAX_CALLS_PER_REPLY // 1.5
    assert most_text < MAX_TOOL_TEXT_CHARS // 3 and most_episode_text < MAX_EPISODE_TOOL_TEXT_CHARS // 5


def test_calls_past_the_per_reply_bound_do_not_run(by_id):
    episode = Episode(by_id[FILE_SYSTEM_ENTRY], budget=EpisodeBudget(calls_per_reply=5))
    step = episode.step("[" + ", ".join(f"mkdir(dir_name='d{i}')" for i in range(8)) + "]")
    texts = [m["content"] for m in step.tool_messages]
    assert len(texts) == 8 and not any(t.startswith("Error") for t in texts[:5])
    assert all(t == "Error during execution: not run: a reply may make at most 5 calls" for t in texts[5:])
    assert episode._decoded_turns[-1][-1][5:] == [NOT_EXECUTED_PLACEHOLDER] * 3  # what the checker sees
    listing = episode.step("[ls()]").tool_messages[0]["content"]
    assert "d4" in listing and "d5" not in listing


def test_default_per_reply_bound_through_a_whole_reply(by_id):
    step = Episode(by_id[FILE_SYSTEM_ENTRY]).step("[" + ", ".join(["pwd()"] * (MAX_CALLS_PER_REPLY + 6)) + "]")
    refused = [m for m in step.tool_messages if "not run: a reply may make at most" in m["content"]]
    assert len(step.tool_messages) == MAX_CALLS_PER_REPLY + 6 and len(refused) == 6


def test_tool_text_is_cut_per_call_and_per_episode(by_id):
    # 12 shared levels: `find` lists 4,096 paths under amp/, ~836k characters.
    episode = built_tree(by_id[FILE_SYSTEM_ENTRY], 12)
    texts = []
    for _ in range(5):
        texts += [m["content"] for m in episode.step(LIST_EVERY_PATH).tool_messages]
    first = texts[0]
    assert first.startswith('{"matches": ["/') and len(first) < MAX_TOOL_TEXT_CHARS + 200
    assert first[:MAX_TOOL_TEXT_CHARS].endswith(first.split("...", 1)[0][-20:])
    cut = int(first.rsplit("... [", 1)[1].split()[0])
    assert cut > 700_000 and f"a tool result may show at most {MAX_TOOL_TEXT_CHARS} characters" in first
    shown = sum(len(t.rsplit("... [", 1)[0]) for t in texts)  # the tree's making showed the rest
    assert episode.budget.text_spent == MAX_EPISODE_TOOL_TEXT_CHARS and shown > MAX_EPISODE_TOOL_TEXT_CHARS - 5000
    assert texts[-1].startswith("... [") and f"reached {MAX_EPISODE_TOOL_TEXT_CHARS} characters" in texts[-1]


def test_a_call_that_grows_memory_is_stopped_at_the_memory_bound():
    # In a fresh interpreter, so the peak is this attack's alone. 26 shared levels: `find` would list 2**26 paths (3.5 GB resident in the
    # 5 s a call was allowed before this bound).
    script = f"""
import json, sys, time
from rcgrpo.envs.bfcl import Episode, load_entries
from rcgrpo.envs.bounded_thread import resident_bytes
from tests.hostile import LIST_EVERY_PATH, shared_tree
entry = next(e for e in load_entries(["base"]) if e.id == {FILE_SYSTEM_ENTRY!r})
episode = Episode(entry)
for reply in shared_tree(26):
    episode.step(reply)
before, started = resident_bytes(), time.monotonic()
text = episode.step(LIST_EVERY_PATH).tool_messages[0]["content"]
# VmHWM: this process's own peak (ru_maxrss would include the parent's at fork).
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps(dict(text=text, seconds=time.monotonic() - started, before=before, after=resident_bytes(),
                      peak=peak)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print({k: v if k == "text" else round(v / 2**20) if k != "seconds" else round(v, 2) for k, v in report.items()})
    assert report["text"] == f"Error during execution: call exceeded the {CALL_MEMORY_BUDGET_BYTES >> 20} MiB memory bound"
    assert report["peak"] - report["before"] < CALL_MEMORY_BUDGET_BYTES + (128 << 20)
    assert report["after"] - report["before"] < 64 << 20  # what the stopped call built is freed
    assert report["seconds"] < 5


@pytest.mark.slow  # builds a deep tree and waits out two bounds (~3 s)
def test_environment_time_per_episode_is_bounded(by_id):
    entry = by_id[FILE_SYSTEM_ENTRY]
    episode = built_tree(entry, 30, call_timeout_s=1.0)
    episode.budget = EpisodeBudget(env_seconds=10.0)  # from here: building the tree is slow on a busy machine
    first = episode.step(WALK_EVERY_PATH)  # a walk over 2**30 paths: stopped at the call's 1 s
    assert first.tool_messages[0]["content"] == "Error during execution: call exceeded the 1 s limit"
    assert not first.done
    episode.budget.spend_seconds(episode.budget.seconds_left - 0.3)  # as if earlier calls had taken the rest
    started = time.monotonic()
    second = episode.step(f"[{WALK_EVERY_PATH[1:-1]}, {WALK_EVERY_PATH[1:-1]}, pwd()]")
    seconds = time.monotonic() - started
    texts = [m["content"] for m in second.tool_messages]
    assert texts[0] == "Error during execution: call exceeded the 0.3 s limit"  # cut to what was left
    assert texts[1:] == ["Error during execution: not run: this episode's 10 s of environment time is spent"] * 2
    assert second.done and episode.end_reason == ENV_TIME_LIMIT and seconds < 3
    result = episode.result()
    assert result.reward == 0.0 and result.end_reason == ENV_TIME_LIMIT


def test_an_episode_stopped_by_its_budget_on_the_last_turn_earns_nothing(entries):
    # Ground truth whose last turn is one call: the call runs as the budget
    # runs out, so state and actions match and only the rule gives reward 0.
    entry = next(e for e in entries if len(ground_truth(e).calls[-1]) == 1 and e.category == "base")
    calls = ground_truth(entry).calls
    episode = Episode(entry)
    for turn in calls[:-1]:
        if turn:
            episode.step_calls(list(turn))
        episode.end_turn()
    episode.budget.spend_seconds(episode.budget.seconds_left - 1e-9)
    step = episode.step_calls(list(calls[-1]))
    assert not step.tool_messages[0]["content"].startswith("Error")
    assert step.done and episode.end_reason == ENV_TIME_LIMIT
    result = episode.result()
    assert (result.r_state, result.r_action, result.reward) == (1.0, 1.0, 0.0)


@pytest.mark.slow  # builds a deep tree twice and waits out two bounds (~3 s)
def test_call_bounds_hold_off_the_main_thread_and_leave_the_callers_timer_alone(by_id):
    entry = by_id[FILE_SYSTEM_ENTRY]
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(time.monotonic()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # the caller's own timer, running across the call
        episode = built_tree(entry, 30, call_timeout_s=0.6)
        text = episode.step(WALK_EVERY_PATH).tool_messages[0]["content"]
        assert text == "Error during execution: call exceeded the 0.6 s limit"
        assert fired and fired[0] < time.monotonic(), "the caller's timer was cancelled"
        assert signal.getsignal(signal.SIGALRM) is not previous  # ours, still installed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    results = {}

    def drive():
        off_main = built_tree(entry, 30, call_timeout_s=0.6)
        started = time.monotonic()
        results["text"] = off_main.step(WALK_EVERY_PATH).tool_messages[0]["content"]
        results["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "a call driven off the main thread ran unbounded"
    assert results["text"] == "Error during execution: call exceeded the 0.6 s limit" and results["seconds"] < 5


@pytest.mark.slow  # 150 races of a call against its bound (~5 s)
def test_a_stop_never_reaches_the_next_call():
    # Calls that end right at their bound race the stop against their own
    # end: whichever wins, the next call runs whole and sees no stray stop.
    runner = BoundedThread()

    def busy(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return "done"

    kinds = set()
    for i in range(150):
        kinds.add(runner.run(lambda: busy(0.01), timeout_s=0.01).kind)
        follow = runner.run(lambda: busy(0.02), timeout_s=5.0)
        assert follow == WorkerOutcome(WorkerOutcome.RETURNED, "done"), (i, follow)
    assert kinds <= {WorkerOutcome.RETURNED, WorkerOutcome.TIMED_OUT}


def test_a_call_that_will_not_stop_is_abandoned_and_the_next_call_runs(monkeypatch):
    # No BFCL method swallows the stop; this stands in for one stuck in a
    # long native operation, which cannot be produced on demand.
    monkeypatch.setattr("rcgrpo.envs.bounded_thread.STOP_GRACE_S", 0.3)
    release = threading.Event()

    def stubborn():
        while not release.is_set():
            try:
                time.sleep(0.005)
            except BaseException:
                pass
        return "finished late"

    runner = BoundedThread()
    try:
        started = time.monotonic()
        outcome = runner.run(stubborn, timeout_s=0.1)
        assert outcome.kind == WorkerOutcome.WORKER_FAILED and "did not stop" in outcome.detail
        assert time.monotonic() - started < 1.5
        assert runner.run(lambda: 42, timeout_s=1.0) == WorkerOutcome(WorkerOutcome.RETURNED, 42)
    finally:
        release.set()


def test_an_episode_whose_call_was_abandoned_runs_nothing_more(by_id, monkeypatch):
    monkeypatch.setattr("rcgrpo.envs.bounded_thread.STOP_GRACE_S", 0.3)
    episode = Episode(by_id[FILE_SYSTEM_ENTRY])
    release = threading.Event()

    def stubborn_ls(**kwargs):
        while not release.is_set():
            try:
                time.sleep(0.005)
            except BaseException:
                pass

    # As above: a stand-in for a method stuck in native code.
    episode._executor.methods["ls"] = ("GorillaFileSystem", stubborn_ls)
    episode._executor.timeout_s = 0.1
    try:
        step = episode.step("[ls(), pwd()]")
    finally:
        release.set()
    assert "did not stop" in step.tool_messages[0]["content"] and "not run" in step.tool_messages[1]["content"]
    assert step.done and episode.result().reward == 0.0
