"""`python -m rcgrpo.eval` (rcgrpo/evaluation/cli.py): replay scoring and the ground-truth table."""
import json
import subprocess
import sys

import pytest

from rcgrpo.envs.bfcl import load_entries
from rcgrpo.envs.reward import ground_truth
from rcgrpo.eval import main


@pytest.fixture(scope="module")
def by_id():
    return {e.id: e for e in load_entries()}


def test_replay_cli_scores_lines_and_reports_bad_ones(tmp_path, by_id, capsys):
    entry = by_id["multi_turn_base_1"]
    gt_turns = [[list(t)] if t else [] for t in ground_truth(entry).canonical_turns()]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"id": entry.id, "turns": gt_turns}),
        "{not json",
        json.dumps({"id": "multi_turn_base_9999", "turns": []}),
        json.dumps({"id": entry.id, "turns": gt_turns[:1]}),
        json.dumps({"id": entry.id, "turns": "oops"}),
        '{"id": "' + entry.id + '", "turns": ' + "[" * 100_000 + "]" * 100_000 + "}",  # past json's recursion
        "[" * 100_000,
        json.dumps({"id": entry.id, "turns": gt_turns}),  # and scoring goes on after them
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--replay", str(src), "--out", str(out)]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8
    assert rows[0] == {"id": entry.id, "valid": True, "r_state": 1.0, "r_action": 1.0, "reward": 1.0}
    assert "malformed JSON" in rows[1]["error"] and rows[1]["line"] == 2
    assert "unknown id" in rows[2]["error"]
    assert rows[3]["id"] == entry.id and rows[3]["valid"] is False and rows[3]["reward"] == 0.0
    assert "malformed turns" in rows[4]["error"]
    assert "nested too deeply" in rows[5]["error"] and rows[5]["line"] == 6
    assert "nested too deeply" in rows[6]["error"] and rows[6]["line"] == 7
    assert rows[7] == rows[0]


@pytest.mark.slow  # the eval CLI replays every entry in a subprocess (~4 s)
def test_ground_truth_cli_prints_full_accuracy():
    proc = subprocess.run([sys.executable, "-m", "rcgrpo.eval", "--ground-truth"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    for name in ("base", "miss_func", "miss_param", "long_context", "overall", "macro"):
        assert lines[name][-1] == "100.00%", proc.stdout
    assert lines["base"][1] == "200"
    # In a log file the bar draws at most one line per 30 s (its start and its end here), not one per redraw.
    assert 1 <= proc.stderr.count("ground truth:") <= 3, proc.stderr[-2000:]


def test_overall_is_the_accuracy_over_all_entries_not_the_mean_of_categories():
    """The paper's overall (a multiple of 1/80 on its test split) pools the
    entries; bfcl_eval's summary, the unweighted mean of the categories, is
    "macro"."""
    from rcgrpo.evaluation.replay_scoring import accuracy_table

    table = accuracy_table([("base", True), ("base", False), ("base", False), ("miss_func", True)])
    assert table["base"] == pytest.approx(1 / 3) and table["miss_func"] == 1.0
    assert table["overall"] == pytest.approx(2 / 4)
    assert table["macro"] == pytest.approx((1 / 3 + 1) / 2)
