"""run.report_to (rcgrpo/run/trackers.py): a chosen tracker that is not installed
is one line before any work; the old run.tensorboard still works and says
what replaces it; W&B and MLflow get every step's numbers (with the real
packages, where installed: they are not in the dev extra, so CI skips those
two; TensorBoard's path is tests/run/test_metrics.py's)."""
import importlib.util

import pytest

from rcgrpo.config import ConfigError, parse_args
from rcgrpo.run.metrics import MetricsLogger
from rcgrpo.run.trackers import TRACKERS

MISSING = [name for name, package in TRACKERS.items() if importlib.util.find_spec(package) is None]


@pytest.mark.skipif(not MISSING, reason="every tracker's package is installed here")
def test_a_chosen_tracker_that_is_not_installed_is_one_line_before_any_work(tmp_path):
    name = MISSING[0]
    with pytest.raises(ConfigError) as info:
        parse_args(["--report-to", f"tensorboard,{name}", "--out-dir", str(tmp_path)])
    assert info.value.problems == [f"run.report_to {name} needs the `{TRACKERS[name]}` package: "
                                   f"pip install {TRACKERS[name]}, or --run.report_to tensorboard"]
    assert not any(tmp_path.iterdir())


def test_unknown_tracker_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"run.report_to: unknown report_to \['comet'\]; known: \['tensorboard'"):
        parse_args(["--run.report_to", "comet"])


def test_the_old_tensorboard_switch_still_works_and_says_what_replaces_it(tmp_path, capsys):
    assert parse_args([]).run.report_to == ["tensorboard"]
    assert parse_args(["--no-run.tensorboard"]).run.report_to is None
    assert capsys.readouterr().err == ("rcgrpo.train: deprecated: --no-run.tensorboard still works, but write "
                                       "--run.report_to none\n")
    assert parse_args(["--report-to", "none", "--run.tensorboard", "true"]).run.report_to == ["tensorboard"]
    saved = tmp_path / "config.toml"  # what runs saved before run.report_to
    saved.write_text("[run]\ntensorboard = false\n")
    assert parse_args(["--config", str(saved)]).run.report_to is None
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and f"deprecated: run.tensorboard (in {saved}) still works, but write " \
        "run.report_to none" in err


def _log_three_steps(run_dir, tracker):
    with MetricsLogger(run_dir, stage="rc-grpo", report_to=[tracker], run_name="r1",
                       config={"grpo": {"lr": 1e-6}}) as log:
        for step in (1, 2, 3):
            log.log(step, reward_mean=0.25 * step, kl=float("nan") if step == 2 else 0.5, note="text")


# In no extra: skipped only where absent (a broken install fails, as tests/test_required.py asks).
@pytest.mark.skipif("wandb" in MISSING, reason="wandb is in no extra and is not installed here")
def test_wandb_gets_each_step(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")  # written under the run folder, never sent
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs, seen = [], {}
    real_init, real_finish = wandb.init, wandb.Run.finish
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append(real_init(**kw)) or runs[-1])
    # The summary (each key's last value) is read just before the run closes.
    monkeypatch.setattr(wandb.Run, "finish", lambda self, *a, **kw: (seen.update(self.summary),
                                                                    real_finish(self, *a, **kw))[1])
    _log_three_steps(tmp_path, "wandb")
    (run,) = runs
    assert (run.name, run.group, run.job_type, run.project) == ("r1/rc-grpo", "r1", "rc-grpo", "rcgrpo")
    assert run.config["grpo"] == {"lr": 1e-6}
    assert seen["reward_mean"] == 0.75 and seen["kl"] == 0.5 and seen["_step"] == 3 and "note" not in seen
    assert list((tmp_path / "wandb").glob("offline-run-*/*.wandb"))


@pytest.mark.skipif("mlflow" in MISSING, reason="mlflow is in no extra and is not installed here")
def test_mlflow_gets_each_step(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the store mlflow-skinny reads without SQLAlchemy
    _log_three_steps(tmp_path / "run", "mlflow")
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("rcgrpo").experiment_id])
    assert run.info.run_name == "r1/rc-grpo" and run.info.status == "FINISHED"
    assert run.data.tags["rcgrpo.run"] == "r1" and run.data.params == {"grpo.lr": "1e-06"}
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "kl")] == [1, 3]
