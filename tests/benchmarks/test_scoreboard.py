"""The benchmark scoreboard (benchmarks/scoreboard.py, benchmarks/conftest.py):
ratios and targets, the table a person reads, the report a session saves,
the smoke's check that fails a session whose figures are missing or not
finite, and the README's table generated from the published report."""
import json
import math
import textwrap

import pytest

from benchmarks import scoreboard
from benchmarks.fresh_process import ROOT
from benchmarks.scoreboard import Comparison, Figure

pytest_plugins = ("pytester",)


def _cmp(**kw):
    base = dict(group="kernels", name="loss", ours="ours", peer="peer", ours_s=1.0, peer_s=4.0, shape="N8",
                ours_peak_gib=0.5, peer_peak_gib=2.0)
    return Comparison(**{**base, **kw})


def test_ratios_and_targets():
    row = _cmp(max_time_ratio=0.5, max_peak_ratio=0.25)
    assert row.time_ratio == 0.25 and row.peak_ratio == 0.25
    assert row.misses() == []
    slow = _cmp(ours_s=3.0, max_time_ratio=0.5)
    assert len(slow.misses()) == 1 and "0.75x" in slow.misses()[0]
    fat = _cmp(ours_peak_gib=1.0, max_peak_ratio=0.25)
    assert len(fat.misses()) == 1 and "peak" in fat.misses()[0]
    # a peak target with no peak measured is a miss, not a pass
    assert _cmp(ours_peak_gib=None, max_peak_ratio=1.0).misses()
    assert _cmp(max_time_ratio=None, max_peak_ratio=None).target() == "reported"
    assert Figure("soak", "escapes", 1, "", "n", max_value=0).misses()
    assert not Figure("soak", "escapes", 0, "", "n", max_value=0).misses()


def test_round_trip_and_problems():
    rows = [_cmp(max_time_ratio=1.0), Figure("soak", "growth", 12.5, "MB", "300 episodes", max_value=200)]
    back = [scoreboard.from_dict(json.loads(json.dumps(scoreboard.to_dict(r)))) for r in rows]
    assert back == rows
    assert scoreboard.problems(rows) == []
    assert len(scoreboard.problems([_cmp(ours_s=math.nan), Figure("a", "b", math.inf, "s", "")])) == 2


def test_table_groups_like_with_like_in_seconds():
    rows = [_cmp(group="update", name="u1"), _cmp(group="kernels", name="k1"), _cmp(group="update", name="u2"),
            Figure("generation", "swap", 0.4, "s", "135M", max_value=1.0)]
    text = scoreboard.text_table(rows, held=True)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["comparison", "ours", "peer"]
    # each group's rows together under its heading, groups in the order first recorded
    assert [line for line in lines if line.startswith("[")] == ["[update]", "[kernels]", "[generation]"]
    assert [line.split()[0] for line in lines if not line.startswith(("[", "-", "comparison"))] == \
        ["u1", "u2", "k1", "swap"]
    assert "0.25x" in text and "<= 1 s" in text and "yes" in text
    md = scoreboard.markdown_table(rows, held=False)
    assert md.count("\n") == len(rows) + 1 and "| - |" in md  # not held: no verdict
    assert [line.split(" | ")[1] for line in md.splitlines()[2:]] == ["u1", "u2", "k1", "swap"]


def test_readme_table_is_generated_from_the_published_report():
    report = json.loads((scoreboard.PUBLISHED / "report.json").read_text())
    readme = scoreboard.README.read_text()
    assert scoreboard.readme_block(report) in readme, (
        "README's scoreboard block differs from benchmarks/results/report.json: "
        "run `python -m benchmarks.scoreboard publish`")
    assert report["scoreboard"]["scale"] == "quick" and scoreboard.rows_of(report)


def test_show_refuses_a_report_without_a_scoreboard(tmp_path, capsys):
    path = tmp_path / "0001_x.json"
    path.write_text(json.dumps({"benchmarks": []}))
    assert scoreboard.main(["show", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no scoreboard" in err


SESSION_TEST = textwrap.dedent("""
    import math
    from benchmarks.scoreboard import Comparison, Figure

    def test_pair(benchmark, board):
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        board.record(Comparison(group="g", name="pair", ours="a", peer="b", ours_s=1.0, peer_s=2.0, shape="tiny",
                                max_time_ratio=1.0))

    def test_figure(benchmark, board):
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        board.record(Figure(group="g", name="fig", value=VALUE, unit="s", shape="tiny"))
""")


def _conftest(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the session imports the benchmark package from the repository
    pytester.makeconftest("from benchmarks.conftest import *  # noqa: F401,F403\n")


def _session(pytester, monkeypatch, value: str, *args):
    _conftest(pytester, monkeypatch)
    pytester.makepyfile(test_bench=SESSION_TEST.replace("VALUE", value))
    return pytester.runpytest_subprocess("--benchmark-only", "-p", "no:cacheprovider", *args)


@pytest.mark.slow
def test_a_session_saves_its_report_with_the_scoreboard(pytester, monkeypatch):
    result = _session(pytester, monkeypatch, "0.5", "--smoke")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*rcgrpo scoreboard (smoke*", "*pair*0.50x*", "saved *.json", "saved *.md",
                                 "saved *.png"])
    (saved,) = (pytester.path / ".benchmarks" / "smoke").glob("*/0001_*.json")
    report = json.loads(saved.read_text())
    assert [r["name"] for r in report["scoreboard"]["rows"]] == ["pair", "fig"]
    assert {"torch", "transformers"} <= set(report["machine_info"]["versions"])
    assert report["machine_info"]["cores"] >= 1 and report["scoreboard"]["scale"] == "smoke"
    assert saved.with_suffix(".png").stat().st_size > 0
    # the next run of the same size compares with this one (pytest-benchmark's own storage)
    again = _session(pytester, monkeypatch, "0.5", "--smoke")
    assert again.ret == 0 and "Comparing against benchmarks from" in again.stdout.str() + again.stderr.str()


@pytest.mark.slow
@pytest.mark.parametrize("value", ["math.nan", "math.inf"])
def test_smoke_fails_on_a_figure_that_is_not_finite(pytester, monkeypatch, value):
    result = _session(pytester, monkeypatch, value, "--smoke")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["PROBLEM: g / fig: a figure is not a finite number*"])


@pytest.mark.slow
def test_smoke_fails_on_a_benchmark_that_records_nothing(pytester, monkeypatch):
    _conftest(pytester, monkeypatch)
    pytester.makepyfile(test_quiet="def test_quiet(benchmark):\n    benchmark.pedantic(lambda: None)\n")
    result = pytester.runpytest_subprocess("--benchmark-only", "-p", "no:cacheprovider", "--smoke")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["PROBLEM: test_quiet.py: its benchmarks passed but recorded nothing*"])
