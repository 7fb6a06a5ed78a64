"""`python -m rcgrpo.eval --model`: a real policy, real rollouts, the official
verdict, and the table written as JSON and markdown."""
import json
import subprocess
import sys


def test_eval_model_writes_the_table(tmp_path):
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "rcgrpo.eval", "--model", "embedded:smollm2-135m-instruct", "--engine", "hf",
         "--subset", "1", "--categories", "base", "--max-new-tokens", "8", "--max-total-tokens", "6144",
         "--doc-style", "compact_no_response", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "eval.json").read_text())
    assert result["n"] == {"base": 1} and result["conditioning"] == "high"
    assert 0.0 <= result["overall"] <= 1.0
    (row,) = result["rows"]
    assert row["id"].startswith("multi_turn_base_") and row["end_reason"]
    table = (out / "eval.md").read_text()
    assert "| method | base | overall |" in table and "| embedded:smollm2-135m-instruct |" in table
    assert "| method | base | overall |" in proc.stdout
