"""The command line of `rcgrpo-report` (`python -m rcgrpo.report`): redraw a
run's plots and report.md (rcgrpo/report/summary.py draws them).

The run is named as rcgrpo-train names it (rcgrpo/base/command_line.py):
``--name NAME`` and ``--out-dir DIR`` (= ``--run.name``, ``--run.out_dir``;
DIR defaults to runs), so ``rcgrpo-report --name X`` redraws what
``rcgrpo-train --name X`` made. The old spelling, the run folder as a
positional argument, still works with one deprecation line.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from rcgrpo.base.command_line import CommandLineError, Section, deprecated, format_help, read_flags, split_argv
from rcgrpo.base.errors import DEBUG_ENV, run_command
from rcgrpo.run.folder import RunFolder

PROG = "rcgrpo.report"
KEYS = {"run.name": str, "run.out_dir": str}
ALIASES = {"name": "run.name", "out-dir": "run.out_dir"}
DEFAULT_OUT_DIR = "runs"  # run.out_dir's default (rcgrpo/config/schema.py), not imported: that would load torch


def usage() -> str:
    return format_help([
        "usage: rcgrpo-report --name NAME [--out-dir DIR]",
        "       (the same: python -m rcgrpo.report)",
        "",
        "Redraws the plots (*.png) and report.md of the run in DIR/NAME from its metrics.jsonl and eval.json.",
    ], [Section("the run", "", [
        ("--run.name NAME", "", "the run's name, as rcgrpo-train --name gave it (shortcut --name)"),
        ("--run.out_dir DIR", f"= {DEFAULT_OUT_DIR}", "the folder holding the runs (shortcut --out-dir)"),
        ("--debug", "", f"show tracebacks (also {DEBUG_ENV}=1)"),
        ("-h, --help", "", "this help"),
    ])])


def _runs(out_dir: Path) -> list[str]:
    """The runs in `out_dir` that have metrics to report."""
    return sorted(p.name for p in out_dir.iterdir() if RunFolder(p).metrics.is_file()) if out_dir.is_dir() else []


def run_folder(argv: Sequence[str]) -> Path:
    """argv -> the run folder to report on."""
    argv = list(argv)
    if argv and not argv[0].startswith("--"):  # `python -m rcgrpo.report runs/x`, the positional days
        folder = Path(argv.pop(0))
        deprecated(PROG, f"a positional run folder ({folder})",
                   f"--name {folder.name} --out-dir {folder.parent.as_posix()}")
        argv = ["--name", folder.name, "--out-dir", str(folder.parent), *argv]
    values = {"run.out_dir": DEFAULT_OUT_DIR}
    for key, value, flag in read_flags(PROG, split_argv(argv), KEYS, ALIASES):
        if not value.strip():
            raise CommandLineError(f"{flag.split('=', 1)[0]} must not be an empty string")
        values[key] = value
    out_dir = Path(values["run.out_dir"])
    runs = _runs(out_dir)
    there = f"runs with metrics there: {', '.join(runs)}" if runs else f"{out_dir} holds no run with metrics"
    if "run.name" not in values:
        raise CommandLineError(f"which run? give --name NAME ({there})")
    if not (out_dir / values["run.name"]).is_dir():
        raise CommandLineError(f"there is no run {values['run.name']!r} in {out_dir} ({there})")
    return out_dir / values["run.name"]


def report_command(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage(), end="")
        return 0
    from rcgrpo.report.summary import write_report

    out = write_report(run_folder(argv))
    print(f"report: {out}")
    for png in sorted(out.parent.glob("*.png")):
        print(f"plot:   {png}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Errors a user can fix are one line and exit code 2 (rcgrpo.base.errors)."""
    return run_command(PROG, report_command, None if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
