"""The command lines fail cleanly: a user's error is one line on stderr and
exit code 2, a bug is one line and exit code 1, --debug shows the traceback,
and an output file is never left half written."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from rcgrpo import eval as eval_cli
from rcgrpo import train as train_cli
from rcgrpo.base.atomic import atomic_output
from rcgrpo.base.errors import DEBUG_ENV, run_command
from rcgrpo.evaluation import replay_scoring
from rcgrpo.model.loading import ModelFolderError


def one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["--grpo.lr", "inf"], "grpo.lr must be a finite number, got inf"),
    (["--rctp.lr", "1e400"], "rctp.lr must be a finite number, got inf"),
    (["--grpo.eps_high", "inf"], "grpo.eps_high must be a finite number"),
    (["--data.seed", "-1"], "data.seed must be in [0, 4294967295]"),
    (["--grpo.lr", "nan", "--grpo.steps", "0"], "grpo.lr must be a finite number, got nan; grpo.steps must be >= 1"),
    (["--no-such.key", "1"], "unknown setting 'no-such.key'"),
    (["--config", "/does/not/exist.toml"], "config file /does/not/exist.toml does not exist"),
    (["--model", "/does/not/exist"], "model folder /does/not/exist does not exist"),
])
def test_train_config_errors_are_one_line_exit_2(capsys, monkeypatch, argv, says):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert train_cli.main(argv) == 2
    assert says in one_line_error(capsys, "rcgrpo.train")


def test_resume_of_a_run_that_does_not_exist_names_the_runs_that_do(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    for name in ("alpha", "beta"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    assert train_cli.main(["--resume", "--name", "gamma", "--out-dir", str(tmp_path)]) == 2
    line = one_line_error(capsys, "rcgrpo.train")
    assert "gamma" in line and "alpha, beta" in line
    assert not (tmp_path / "gamma").exists()  # nothing was started


@pytest.mark.parametrize("content, says", [
    (b'{"entry_id": 1}\n', "RCTP data file is malformed"),
    (b"\xff\xfe garbage", "is not UTF-8 text"),
    (b"", "holds no records"),
])
def test_a_bad_rctp_data_file_is_one_line(tmp_path, capsys, monkeypatch, content, says):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    argv = ["--stages", "rctp", "--rctp.data_file", str(data), "--out-dir", str(tmp_path / "runs"),
            "--data.entry_ids", "multi_turn_base_1"]
    assert train_cli.main(argv) == 2
    line = one_line_error(capsys, "rcgrpo.train")
    assert says in line and str(data) in line


@pytest.mark.parametrize("argv, says", [
    (["--replay", "x.jsonl"], "--replay needs --out"),
    (["--model", "m", "--split", "dev"], "--split must be one of ('test', 'train'), got 'dev'"),
    (["--nonsense"], "unknown flag --nonsense"),
    (["--max-tokens", "5"], "unknown flag --max-tokens; did you mean --max-new-tokens?"),
    (["--subset", "2"], "give exactly one of --model, --replay, --ground-truth"),
    (["--ground-truth", "--subset", "many"], "eval.subset: expected int, got 'many'"),
    (["--model", "m", "positional"], "unexpected argument 'positional'"),
])
def test_eval_usage_errors_are_one_line(capsys, monkeypatch, argv, says):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert eval_cli.main(argv) == 2
    assert says in one_line_error(capsys, "rcgrpo.eval")


def test_eval_model_that_does_not_exist(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert eval_cli.main(["--model", "/does/not/exist"]) == 2
    assert "model folder /does/not/exist does not exist" in one_line_error(capsys, "rcgrpo.eval")


def test_debug_flag_and_variable_let_the_traceback_through(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(ModelFolderError):
        eval_cli.main(["--model", "/does/not/exist", "--debug"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ModelFolderError):
        eval_cli.main(["--model", "/does/not/exist"])


def test_a_bug_is_one_line_with_exit_1_and_names_the_debug_switch(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def body(argv):
        return {}["missing"]  # a real KeyError from a body with a bug

    assert run_command("tool", body, []) == 1
    line = one_line_error(capsys, "tool")
    assert "internal error: KeyError" in line and "--debug" in line


def test_replay_lines_with_bad_ids_are_error_rows(tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"id": ["multi_turn_base_0"], "turns": []},
        {"id": {"a": 1}, "turns": []},
        {"id": 7, "turns": []},
        {"id": "multi_turn_base_0", "turns": [[["ls()" * 400]]]},
    ]) + "\n")
    assert eval_cli.main(["--replay", str(src), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("error", "") for r in rows[:3]] == [
        "'id' must be a string, got list", "'id' must be a string, got dict", "'id' must be a string, got int"]
    assert rows[3]["id"] == "multi_turn_base_0" and rows[3]["valid"] is False


def test_replay_file_that_is_not_utf8(tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b'{"id": "multi_turn_base_0", "turns": []}\n\xff\xfe\x00garbage\n')
    out.write_text("previous results\n")
    assert eval_cli.main(["--replay", str(src), "--out", str(out)]) == 2
    assert "is not UTF-8 text" in one_line_error(capsys, "rcgrpo.eval")
    assert out.read_text() == "previous results\n"


def test_replay_out_is_atomic_when_scoring_fails_midway(tmp_path, monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps({"id": "multi_turn_base_0", "turns": []}) for _ in range(3)) + "\n")
    out.write_text("previous results\n")
    calls = []
    real = replay_scoring._score_line

    def fails_on_the_second_line(*args):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("simulated: the machine ran out of memory")  # cannot be provoked safely for real
        return real(*args)

    monkeypatch.setattr(replay_scoring, "_score_line", fails_on_the_second_line)
    with pytest.raises(MemoryError):
        replay_scoring.score_replay_file(src, out)
    assert out.read_text() == "previous results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_a_killed_writer_leaves_the_previous_file(tmp_path):
    """A real SIGKILL in the middle of an atomic write: the old content stays."""
    target = tmp_path / "results.jsonl"
    target.write_text("old\n")
    child = textwrap.dedent(f"""
        import os, signal
        from rcgrpo.base.atomic import atomic_output
        with atomic_output({str(target)!r}) as f:
            f.write("new, half written\\n" * 1000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child])
    assert proc.returncode == -signal.SIGKILL
    assert target.read_text() == "old\n"
    # The next write succeeds and replaces it whole.
    with atomic_output(target) as f:
        f.write("new\n")
    assert target.read_text() == "new\n"
    # The killed writer's temporary file went with that next write.
    assert [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]


def test_replay_out_onto_what_is_not_a_regular_file(tmp_path, capsys):
    """`--out /dev/null` discards (as a shell redirection would) and leaves
    the device a device; a link keeps pointing where it did; a folder is one
    line of error with nothing written."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "multi_turn_base_0", "turns": []}) + "\n")
    # A null device of our own: a regression run as root must not turn the
    # machine's /dev/null into a file. Without the right to make one, the
    # system's is safe to use (only root could replace it).
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        device = Path(os.devnull)
    assert eval_cli.main(["--replay", str(src), "--out", str(device)]) == 0
    assert stat.S_ISCHR(os.stat(device).st_mode)

    real, link = tmp_path / "results.jsonl", tmp_path / "latest.jsonl"
    real.write_text("old\n")
    link.symlink_to(real)
    assert eval_cli.main(["--replay", str(src), "--out", str(link)]) == 0
    assert link.is_symlink() and json.loads(real.read_text())["id"] == "multi_turn_base_0"

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    with atomic_output(fifo) as f:
        f.write("through the pipe\n")
    reader.join(timeout=30)
    assert received == ["through the pipe\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)

    folder = tmp_path / "a_folder"
    folder.mkdir()
    assert eval_cli.main(["--replay", str(src), "--out", str(folder)]) == 2
    assert "is a folder" in one_line_error(capsys, "rcgrpo.eval")
    assert list(folder.iterdir()) == []


HOLD_RUN_FOLDER = """
import sys, time
from rcgrpo.run.lock import RunFolderLock
RunFolderLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("resume", [False, True])
def test_a_second_trainer_on_a_held_run_folder_is_one_line_naming_the_holder(tmp_path, capsys, monkeypatch, resume):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_FOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["--name", "shared", "--out-dir", str(tmp_path)] + (["--resume"] if resume else [])
        assert train_cli.main(argv) == 2
        line = one_line_error(capsys, "rcgrpo.train")
        assert f"in use by process {holder.pid}" in line, line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]  # no shared-2 was started either
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    from rcgrpo.run.lock import RunFolderLock, RunInUseError, holder_of

    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_FOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert holder_of(folder) == str(holder.pid)
    with pytest.raises(RunInUseError, match=str(holder.pid)):
        RunFolderLock(folder).acquire()
    holder.kill()  # SIGKILL: no clean-up ran
    holder.wait()
    assert holder_of(folder) is None
    with RunFolderLock(folder):
        assert (folder / ".lock").read_text() == f"{os.getpid()}\n"
        assert holder_of(folder) == str(os.getpid())
    assert holder_of(folder) is None  # released on exit
