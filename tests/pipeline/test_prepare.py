"""Validate before any work, and finish with the right code (issue 23, item 9).

A problem the user can fix is found before any model loads and before the
run folder is made, and is one line with exit code 2; a run that does what
was asked ends with exit code 0. Each defect is checked through a command's
`main` (argv in; exit code, stdout and stderr out), in-process and with the
model loaders replaced by tripwires, so that a check that comes too late
fails the test instead of loading a model. The commands' own entry points
(`python -m rcgrpo.train`, exit codes 2 and 0) run in a subprocess once,
where the process is the subject: a file-size limit on the process (slow).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rcgrpo import eval as eval_cli
from rcgrpo import train as train_cli
from rcgrpo.base.errors import DEBUG_ENV
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD

ENTRY = "multi_turn_base_100"  # one of the cpu-small preset's entries (its prompt fits)
ROOT = Path(__file__).resolve().parents[2]
MAINS = {"rcgrpo.train": train_cli.main, "rcgrpo.eval": eval_cli.main}


def cli_process(cwd: Path, module: str, *args: str, timeout: int = 300, preexec=None) -> subprocess.CompletedProcess:
    """`python -m module args` in a fresh interpreter, importing this checkout's rcgrpo."""
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec)


@pytest.fixture
def cli(capsys, monkeypatch):
    """`python -m module args` run from `cwd` as its `main`, in this process:
    the exit code main returns and what it wrote, as a CompletedProcess."""
    def run(cwd: Path, module: str, *args: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        monkeypatch.delenv(DEBUG_ENV, raising=False)
        capsys.readouterr()
        code = MAINS[module](list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([module, *args], code, out, err)
    return run


def one_error_line(proc: subprocess.CompletedProcess, prog: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{prog}: ")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Tripwires on every way a CLI loads weights or starts an engine."""
    from rcgrpo import rollout
    from rcgrpo.model.policy import TrainablePolicy

    def tripped(*args, **kwargs):
        raise AssertionError("a model was loaded before the problem was found")

    monkeypatch.setattr(TrainablePolicy, "load", classmethod(tripped))
    monkeypatch.setattr(rollout, "make_engine", tripped)
    monkeypatch.delenv(DEBUG_ENV, raising=False)


def record(**changes) -> dict:
    row = {"entry_id": ENTRY, "kind": "expert", "reward": 1.0, "r_state": 1.0, "r_action": 1.0, "valid": True,
           "reward_token": HIGH_REWARD, "token_ids": [1, 2, 3], "sampled_mask": [0, 1, 1],
           "end_reason": "completed"}
    return {**row, **changes}


# ---------------------------------------------------------- RCTP data file


@pytest.mark.parametrize("changes, field", [
    ({"token_ids": [1, 10**9, 3]}, "token_ids[1]: 1000000000 is outside the tokenizer's"),
    ({"token_ids": [1, -1, 3]}, "token_ids[1]: -1 is outside"),
    ({"token_ids": [1, True, 3]}, "token_ids[1]: expected an integer token id, got True"),
    ({"token_ids": [1, 2.5, 3]}, "token_ids[1]: expected an integer token id, got 2.5"),
    ({"token_ids": [1, [2], 3]}, "token_ids[1]: expected an integer token id, got [2]"),
    ({"token_ids": "123"}, "token_ids: expected a list of integers, got str"),
    ({"sampled_mask": [0, 2, 1]}, "sampled_mask[1]: expected 0 or 1, got 2"),
    ({"reward": "high"}, "reward: expected a finite number"),
    ({"kind": "gold"}, "kind: expected one of"),
])
def test_rctp_data_file_fields_are_checked_before_the_model_loads(tmp_path, capsys, no_model_loads, changes, field):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record()) + "\n" + json.dumps(record(**changes)) + "\n")
    runs = tmp_path / "runs"
    argv = ["--stages", "rctp", "--rctp.data_file", str(data), "--out-dir", str(runs)]
    assert train_cli.main(argv) == 2
    line = one_line_error(capsys, "rcgrpo.train")
    assert f"{data}:2 (record 2, entry '{ENTRY}')" in line and field in line, line
    assert not runs.exists()  # found before the run folder was made


def test_rctp_token_id_outside_the_vocabulary_through_the_cli(tmp_path, cli, no_model_loads):
    """Before: the model loaded, then its embedding failed (internal error, exit 1)."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record(token_ids=[1, 49154, 3])) + "\n")  # 49154 rows: ids 0..49153
    proc = cli(tmp_path, "rcgrpo.train", "--stages", "rctp", "--rctp.data_file", str(data), "--out-dir", "runs")
    line = one_error_line(proc, "rcgrpo.train")
    assert "token_ids[1]: 49154 is outside the tokenizer's 49154 token ids" in line and str(data) in line
    assert not (tmp_path / "runs").exists()


def test_the_rctp_stage_without_its_data_set_is_refused_up_front(tmp_path, capsys, no_model_loads):
    """`--stages rctp` on a fresh run has no RCTP set to train on: before, the
    run folder was made and the error came after (and the retry became -2)."""
    runs = tmp_path / "runs"
    for _ in range(2):  # the retry says the same, under the same name
        assert train_cli.main(["--stages", "rctp", "--out-dir", str(runs), "--name", "r"]) == 2
        line = one_line_error(capsys, "rcgrpo.train")
        assert "run.stages: rctp needs the RCTP data set" in line and str(runs / "r" / "rctp_data.jsonl") in line
        assert not runs.exists()


# ---------------------------------------------------------- counts and empty settings


@pytest.mark.parametrize("argv, says", [
    (["--subset", "0"], "--subset must be >= 1, got 0"),
    (["--subset", "-1"], "--subset must be >= 1, got -1"),
    (["--eval.max_new_tokens", "0"], "--eval.max_new_tokens must be >= 1, got 0"),
    (["--grpo.max_total_tokens=0"], "--grpo.max_total_tokens must be >= 1, got 0"),
    (["--categories", ""], "--categories must not be empty"),
    (["--categories", "base,"], "--categories has an empty item"),
    (["--ids", ""], "--ids must not be empty"),
    (["--out", ""], "--out must not be an empty string"),
])
def test_eval_counts_and_lists_are_refused_before_any_model_loads(capsys, no_model_loads, argv, says):
    assert eval_cli.main(["--model", "embedded:smollm2-135m-instruct", *argv]) == 2
    assert says in one_line_error(capsys, "rcgrpo.eval")


@pytest.mark.parametrize("argv", [["--model", ""], ["--replay", "", "--out", "x.jsonl"]])
def test_eval_empty_model_or_replay_path_is_refused(capsys, no_model_loads, argv):
    """Before: --model '' was resolved as a model name, --replay '' read the working directory."""
    assert eval_cli.main(argv) == 2
    assert f"error: {argv[0]} must not be an empty string" in one_line_error(capsys, "rcgrpo.eval")


def test_eval_subset_0_through_the_cli(tmp_path, cli, no_model_loads):
    """Before: the model loaded, 0 entries were evaluated, exit 0."""
    proc = cli(tmp_path, "rcgrpo.eval", "--model", "embedded:smollm2-135m-instruct", "--subset", "0")
    assert "error: --subset must be >= 1, got 0" in one_error_line(proc, "rcgrpo.eval")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv, says", [
    (["--name", ""], "run.name must not be an empty string"),
    (["--data.entry_ids", ""], "data.entry_ids must not be empty"),
    (["--data.entry_ids", f"{ENTRY},,multi_turn_base_104"], "data.entry_ids has an empty item"),
    (["--stages", ""], "run.stages must not be empty"),
    (["--stages", "rctp-data,"], "run.stages has an empty item"),
    (["--run.out_dir", ""], "run.out_dir must not be an empty string"),
    (["--model", ""], "model.name_or_path must not be an empty string"),
    (["--rctp.data_file", ""], "rctp.data_file must not be an empty string"),
    (["--grpo.group_size", "100000"], "grpo.group_size must be in [2, 1024]"),
    (["--grpo.batch_size", "100000"], "grpo.batch_size must be in [1, 16384]"),
])
def test_empty_and_out_of_bound_settings_are_one_line_before_the_run_starts(capsys, monkeypatch, argv, says):
    """Before: an empty value meant the default ("all" stages, every entry, the
    pipeline's name) and the run went ahead."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def started(cfg):
        raise AssertionError(f"the run started with {cfg.run.name=} {cfg.run.stages=} {cfg.data.entry_ids=}")

    monkeypatch.setattr(train_cli, "run", started)
    assert train_cli.main(argv) == 2
    line = one_line_error(capsys, "rcgrpo.train")
    assert says in line and "; " not in line.split("invalid configuration: ", 1)[1], line  # said once


def test_empty_name_through_the_cli(tmp_path, cli, no_model_loads):
    proc = cli(tmp_path, "rcgrpo.train", "--name", "", "--out-dir", "runs")
    assert "run.name must not be an empty string" in one_error_line(proc, "rcgrpo.train")
    assert not (tmp_path / "runs").exists()


def test_a_group_too_big_for_the_host_is_refused_by_the_memory_plan(tmp_path, cli, no_model_loads):
    """Before: accepted, and the rollouts of a step (batch x group) were held
    in memory until it ran out. Within the schema's bounds, the memory plan
    names the setting, its figure and a group size that fits."""
    proc = cli(tmp_path, "rcgrpo.train", "--grpo.group_size", "1000", "--grpo.batch_size", "16384",
               "--out-dir", "runs")
    line = one_error_line(proc, "rcgrpo.train")
    assert "memory plan: stage rc-grpo does not fit" in line
    assert "rollouts held (16384000: grpo.batch_size 16384 x grpo.group_size 1000" in line
    assert "ways out: " in line  # which depends on the host's memory (tests/training/test_memory_plan.py names them)
    assert not (tmp_path / "runs").exists()


def test_failure_attempts_too_many_for_the_host_are_refused_before_the_run_folder(tmp_path, capsys, no_model_loads):
    """rctp-data plays every training entry's failure attempts at once."""
    argv = ["--rctp.failure_source", "rollouts", "--rctp.failure_attempts", "10000000", "--out-dir",
            str(tmp_path / "runs")]
    assert train_cli.main(argv) == 2
    line = one_line_error(capsys, "rcgrpo.train")
    assert "memory plan: stage rctp-data does not fit" in line
    assert "rollouts held (20000000: 2 training entries x rctp.failure_attempts 10000000" in line
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------- finishing


# ---------------------------------------------------------- the run folder


def _limit_file_size(limit: int):
    def apply():
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow  # two fresh interpreters, one under a file-size limit, the retry collecting data (~12 s)
def test_a_start_that_fails_after_making_its_folder_removes_it_and_the_retry_keeps_the_name(tmp_path):
    """A real failure after the folder is claimed: writing config.toml fails
    (a file-size limit of 1 kB, an EFBIG as a full disk gives ENOSPC). Before:
    the folder stayed, holding a lock file and an empty config.toml, and the
    retry ran as d-2 with a hint to --resume a run that never began."""
    proc = cli_process(tmp_path, "rcgrpo.train", "--stages", "rctp-data", "--out-dir", "runs", "--name", "d",
                       preexec=_limit_file_size(1024))
    assert "File too large" in one_error_line(proc, "rcgrpo.train")
    assert list((tmp_path / "runs").iterdir()) == []
    # The retry is data collection alone: it finishes with exit 0 and says what it made.
    retry = cli_process(tmp_path, "rcgrpo.train", "--stages", "rctp-data", "--out-dir", "runs", "--name", "d")
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["d"] and "--resume" not in retry.stderr
    data = Path("runs") / "d" / "rctp_data.jsonl"
    records = (tmp_path / data).read_text().splitlines()
    assert retry.stdout.splitlines()[-1] == (
        f"done: stages ['rctp-data'] produced {data} ({len(records)} records); no training stage ran, so no report")


def test_a_fresh_run_beside_a_folder_that_is_no_run_is_not_told_to_resume_it(tmp_path, capsys):
    from rcgrpo.config import parse_args

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    cfg = parse_args(["--name", "x", "--out-dir", str(tmp_path)])
    train_cli.claim_fresh_run_dir(cfg)
    assert cfg.run.name == "x-2"
    err = capsys.readouterr().err
    assert f"{tmp_path / 'x'} holds no run to resume" in err and "--resume" not in err
    (tmp_path / "x" / "config.json").write_text("{}")
    cfg = parse_args(["--name", "x", "--out-dir", str(tmp_path)])
    train_cli.claim_fresh_run_dir(cfg)
    assert "pass --resume to continue x" in capsys.readouterr().err


# ---------------------------------------------------------- files the user hands us

NOT_UTF8 = b'{"hidden_size": 8}\xff\xfe'
TOO_DEEP = b"[" * 100_000 + b"]" * 100_000
NOT_AN_OBJECT = b"[1, 2]"


def test_a_config_file_not_utf8_through_the_cli(tmp_path, cli, no_model_loads):
    """Before: internal error: UnicodeDecodeError (exit 1)."""
    (tmp_path / "c.toml").write_bytes(b"[grpo]\nlr = 1e-6\n\xff\xfe\n")
    proc = cli(tmp_path, "rcgrpo.train", "--config", "c.toml", "--out-dir", "runs")
    assert "config file c.toml is not UTF-8 text (byte 17" in one_error_line(proc, "rcgrpo.train")


def test_a_config_file_nested_too_deeply_through_the_cli(tmp_path, cli, no_model_loads):
    """Before: internal error: RecursionError (exit 1)."""
    (tmp_path / "c.toml").write_bytes(b"a = " + TOO_DEEP + b"\n")
    proc = cli(tmp_path, "rcgrpo.train", "--config", "c.toml", "--out-dir", "runs")
    assert "config file c.toml is not valid TOML: nested too deeply to read" in one_error_line(proc, "rcgrpo.train")


@pytest.mark.parametrize("content, says", [
    (NOT_UTF8, "is not UTF-8 text (byte 18"),
    (TOO_DEEP, "is not valid JSON: nested too deeply to read"),
    (NOT_AN_OBJECT, "holds a JSON array, not a JSON object"),
    (b'{"hidden_size": "wide", "intermediate_size": 1, "num_hidden_layers": 1, "vocab_size": 1}',
     "invalid literal for int()"),
])
def test_a_model_folder_whose_config_json_cannot_be_used(tmp_path, capsys, no_model_loads, content, says):
    """Before: internal error: ValueError (exit 1), and a run folder left behind."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(content)
    assert train_cli.main(["--model", str(model), "--out-dir", str(tmp_path / "runs")]) == 2
    line = one_line_error(capsys, "rcgrpo.train")
    assert f"model config {model / 'config.json'} cannot be used: " in line and says in line, line
    assert not (tmp_path / "runs").exists()


def test_a_model_config_json_not_utf8_through_the_cli(tmp_path, cli, no_model_loads):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_bytes(NOT_UTF8)
    proc = cli(tmp_path, "rcgrpo.train", "--model", "./model", "--out-dir", "runs")
    assert "model config model/config.json cannot be used: model/config.json is not UTF-8 text" \
        in one_error_line(proc, "rcgrpo.train")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("content, says", [
    (NOT_UTF8, "is not UTF-8 text"),
    (TOO_DEEP, "nested too deeply to read"),
    (NOT_AN_OBJECT, "holds a JSON array, not a JSON object"),
])
def test_resume_of_a_run_whose_saved_config_cannot_be_used(tmp_path, capsys, no_model_loads, content, says):
    """Before: a JSON array gave internal error: AttributeError (exit 1)."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_bytes(content)
    assert train_cli.main(["--resume", "--name", "r", "--out-dir", str(tmp_path)]) == 2
    line = one_line_error(capsys, "rcgrpo.train")
    assert f"--resume: the saved config {run / 'config.json'} cannot be used" in line and says in line, line
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]  # nothing written into the run


def test_eval_of_a_run_whose_config_toml_is_nested_too_deeply(tmp_path, cli, no_model_loads):
    """Before: internal error: RecursionError (exit 1)."""
    stage = tmp_path / "runs" / "r" / "models" / "rctp"
    stage.mkdir(parents=True)
    (tmp_path / "runs" / "r" / "config.toml").write_bytes(b"a = " + TOO_DEEP + b"\n")
    proc = cli(tmp_path, "rcgrpo.eval", "--model", str(stage))
    assert "runs/r/config.toml is not valid TOML: nested too deeply to read" in one_error_line(proc, "rcgrpo.eval")


def test_under_torchrun_only_rank_0_checks_that_the_run_folder_is_free(tmp_path, monkeypatch):
    """Rank 0 claims the folder once its own checks pass; a peer still
    checking must not take rank 0's lock for another run's."""
    from rcgrpo.config import parse_args
    from rcgrpo.run.lock import RunFolderLock

    cfg = parse_args(["--stages", "rctp-data", "--out-dir", str(tmp_path), "--name", "r"])
    with RunFolderLock(cfg.run_dir):  # rank 0, already past its checks
        monkeypatch.setattr(train_cli.distributed, "is_main", lambda: False)
        assert train_cli.prepare(cfg).entries  # a peer's checks pass
        monkeypatch.setattr(train_cli.distributed, "is_main", lambda: True)
        with pytest.raises(train_cli.RunInUseError, match=f"in use by process {os.getpid()}"):
            train_cli.prepare(cfg)  # rank 0 of another job is refused
