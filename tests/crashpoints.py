"""Crash points: SIGKILL a real process just before a chosen line of
`rcgrpo/run/checkpoint.py` runs (a line tracer, active only inside a save).

    python -m tests.crashpoints sweep WORKDIR
        For every distinct line a checkpoint save executes, fork a process
        that saves and kills itself just before that line; after each kill,
        `load_latest` runs in the surviving parent. Two scenarios: a new step
        (pruning the older one) and a re-save of an existing step. Prints one
        JSON object per crash point.

    python -m tests.crashpoints train NTH_SAVE LINE_TEXT -- TRAIN_ARGS...
        `python -m rcgrpo.train TRAIN_ARGS`, killed during its NTH_SAVE-th
        checkpoint save just before the line of `save_checkpoint` whose text
        is LINE_TEXT.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

CHECKPOINT_FILE = str(Path(__file__).resolve().parents[1] / "rcgrpo" / "run" / "checkpoint.py")


def line_of(text: str, function: str) -> int:
    """The number of the one line of checkpoint.py's `function` that reads
    `text` (stripped)."""
    import inspect

    import rcgrpo.run.checkpoint

    source, first = inspect.getsourcelines(getattr(rcgrpo.run.checkpoint, function))
    lines = [first + i for i, line in enumerate(source) if line.strip() == text]
    if len(lines) != 1:
        raise LookupError(f"{len(lines)} lines of checkpoint.{function} read {text!r}")
    return lines[0]


def traced(fn, on_line):
    """Run fn() with `on_line(lineno)` called before each line of checkpoint.py."""

    def local(frame, event, arg):
        if event == "line":
            on_line(frame.f_lineno)
        return local

    def global_(frame, event, arg):
        return local if frame.f_code.co_filename == CHECKPOINT_FILE else None

    sys.settrace(global_)
    try:
        return fn()
    finally:
        sys.settrace(None)


def kill_before(lineno: int):
    def on_line(current):
        if current == lineno:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_line


# ------------------------------------------------------------------ sweep


def _sweep(workdir: Path) -> None:
    import torch

    torch.set_num_threads(1)  # the sweep forks: keep this process free of worker threads
    from rcgrpo.model.loading import load_model_weights
    from rcgrpo.run.checkpoint import load_latest, save_checkpoint
    from tests.run.test_checkpoint import tiny_model

    def weights(seed):
        model = tiny_model(seed)
        return model, {k: v.clone() for k, v in model.state_dict().items()}

    models = {seed: weights(seed) for seed in (1, 2, 3)}

    def save(root, step, seed, keep_last):
        model, _ = models[seed]
        opt = torch.optim.AdamW(model.parameters())
        return save_checkpoint(root, step, model, optimizer=opt, keep_last=keep_last, extra={"seed": seed})

    # scenario -> (what is on disk before, the save that gets killed, the seeds a load may find per step)
    scenarios = {
        "new-step": ([(1, 1)], (2, 2, 1)),
        "re-save": ([(1, 1), (2, 2)], (2, 3, 2)),
    }
    for name, (before, (step, seed, keep_last)) in scenarios.items():
        template = workdir / f"{name}-template"
        for s, sd in before:
            save(template, s, sd, keep_last=2)
        events = []
        traced(lambda: save(workdir / f"{name}-dry", step, seed, keep_last), events.append)
        firsts = list(dict.fromkeys(events))  # each distinct line, in the order first reached
        for lineno in firsts:
            root = workdir / f"{name}-{lineno}"
            shutil.copytree(template, root)
            pid = os.fork()
            if pid == 0:
                traced(lambda: save(root, step, seed, keep_last), kill_before(lineno))
                os._exit(0)  # the line was not reached on this path
            _, status = os.waitpid(pid, 0)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            state = sorted(p.name for p in root.iterdir())
            row = {"scenario": name, "line": lineno, "killed": killed, "on_disk": state}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ck = load_latest(root)
            except Exception as exc:  # reported, and the test fails on it
                row["error"] = f"{type(exc).__name__}: {exc}"
            else:
                row["step"] = None if ck is None else ck.step
                if ck is not None:
                    row["seed"] = ck.extra["seed"]
                    model, _ = weights(0)
                    load_model_weights(model, ck.model_dir)
                    got = model.state_dict()
                    row["weights_match_seed"] = all(torch.equal(got[k], v) for k, v in models[ck.extra["seed"]][1].items())
                    # and the run can go on saving there
                    save(root, step + 1, seed, keep_last)
                    row["next_save_loads"] = load_latest(root).step == step + 1
            print(json.dumps(row), flush=True)
            shutil.rmtree(root)


# ------------------------------------------------------------------ trainer


def _train(nth_save: int, line_text: str, train_args: list[str]) -> None:
    import runpy

    import rcgrpo.pipeline.run as run_module

    original, count = run_module.save_checkpoint, [0]
    lineno = line_of(line_text, "save_checkpoint")

    def save_checkpoint(*args, **kwargs):
        count[0] += 1
        if count[0] != nth_save:
            return original(*args, **kwargs)
        return traced(lambda: original(*args, **kwargs), kill_before(lineno))

    run_module.save_checkpoint = save_checkpoint
    sys.argv = ["rcgrpo.train", *train_args]
    runpy.run_module("rcgrpo.train", run_name="__main__")


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "sweep":
        _sweep(Path(rest[0]))
    elif mode == "train":
        nth, text, sep, *args = rest
        assert sep == "--", "usage: train NTH_SAVE LINE_TEXT -- TRAIN_ARGS..."
        _train(int(nth), text, args)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
