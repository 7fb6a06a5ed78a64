"""`python -m rcgrpo.eval --model`: a real policy, real rollouts, the official
verdict, and the table written as JSON and markdown."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the eval CLI loads the 135M model in a subprocess (~49 s, ~1.5 s)


def eval_cli(*args):
    return subprocess.run([sys.executable, "-m", "rcgrpo.eval", "--model", "embedded:smollm2-135m-instruct", *args],
                          capture_output=True, text=True)


def test_eval_model_writes_the_table(tmp_path):
    from rcgrpo.evaluation.rollouts import select_entries

    out = tmp_path / "eval"
    wanted = select_entries("test", ["base"], None)[1].id  # not the first: --ids must really select
    proc = eval_cli("--engine", "hf", "--ids", wanted, "--categories", "base", "--max-new-tokens", "8",
                    "--max-total-tokens", "6144", "--doc-style", "compact_no_response", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "eval.json").read_text())
    # The embedded model had no reward tokens before rcgrpo added them: unconditioned by default.
    assert result["n"] == {"base": 1} and result["conditioning"] == "none"
    settings = result["settings"]
    assert settings["source"] == "built-in defaults" and settings["conditioning"] == "none"
    assert (settings["max_new_tokens"], settings["max_total_tokens"], settings["doc_style"]) == (
        8, 6144, "compact_no_response")
    assert "settings from built-in defaults: max_new_tokens 8 (flag)" in proc.stdout
    assert 0.0 <= result["overall"] <= 1.0
    (row,) = result["rows"]
    assert row["id"] == wanted and row["end_reason"]
    table = (out / "eval.md").read_text()
    assert "| method | base | overall |" in table and "| embedded:smollm2-135m-instruct |" in table
    assert "| method | base | overall |" in proc.stdout


def test_eval_ids_outside_the_split_are_named():
    proc = eval_cli("--split", "test", "--ids", "multi_turn_base_0,no_such_entry", "--categories", "base")
    assert proc.returncode != 0
    assert "no_such_entry" in proc.stderr and "test split" in proc.stderr
