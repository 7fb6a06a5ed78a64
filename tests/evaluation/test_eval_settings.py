"""`python -m rcgrpo.eval --model`: which settings a model is evaluated under
(its run's config.toml, explicit flags, built-in defaults). No engine starts."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rcgrpo.conditioning.reward_tokens import REWARD_TOKENS, stage_saw_reward_tokens
from rcgrpo.config import parse_args, save_config
from rcgrpo.eval import main
from rcgrpo.evaluation.settings import EvalSettingsError, resolve_eval_settings
from rcgrpo.model.loading import EMBEDDED

ROOT = Path(__file__).resolve().parents[2]


def flags(**given):
    """The argparse namespace of `--model` with only `given` set explicitly."""
    values = dict(max_new_tokens=None, max_total_tokens=None, doc_style=None, conditioning=None)
    values.update(given)
    return argparse.Namespace(**values)


def make_run(root: Path, *argv: str, name: str = "run", stage: str = "rctp") -> Path:
    """A run folder as the trainer leaves it (config.toml) with an empty
    models/<stage>; returns the stage folder, relative to `root`."""
    run_dir = root / "runs" / name
    save_config(parse_args(list(argv), check_files=False), run_dir)
    (run_dir / "models" / stage).mkdir(parents=True, exist_ok=True)
    return Path("runs") / name / "models" / stage


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_cpu_small_run_supplies_its_settings(in_tmp):
    model = make_run(in_tmp, stage="rctp")  # no preset, no model: cpu-small, rctp+rc-grpo
    s = resolve_eval_settings(str(model), flags())
    assert (s.max_new_tokens, s.max_total_tokens, s.doc_style, s.conditioning) == (
        96, 4096, "compact_no_response", "high")
    assert s.source == "runs/run/config.toml" and s.stage == "rctp" and s.from_flags == []
    assert s.describe() == ("settings from runs/run/config.toml: max_new_tokens 96, max_total_tokens 4096, "
                            "doc_style compact_no_response, conditioning high (stage rctp)")


def test_paper_sized_run_supplies_its_own_numbers(in_tmp):
    model = make_run(in_tmp, "--preset", "none", "--eval.max_new_tokens", "300", "--grpo.max_total_tokens", "12000",
                     "--data.doc_style", "official", "--eval.conditioning", "low", stage="rc-grpo")
    s = resolve_eval_settings(str(model), flags())
    assert (s.max_new_tokens, s.max_total_tokens, s.doc_style, s.conditioning) == (300, 12000, "official", "low")


@pytest.mark.parametrize("pipeline, stage, conditioning", [
    ("rctp+rc-grpo", "rctp", "high"),
    ("rctp+rc-grpo", "rc-grpo", "high"),
    ("rctp+grpo", "rctp", "high"),
    ("rctp+grpo", "grpo", "high"),
    ("sft+grpo", "sft", "none"),
    ("sft+grpo", "grpo", "none"),
    ("sft+rc-grpo", "sft", "none"),
    ("sft+rc-grpo", "rc-grpo", "high"),
])
def test_conditioning_follows_what_the_stage_was_trained_on(in_tmp, pipeline, stage, conditioning):
    model = make_run(in_tmp, "--pipeline", pipeline, name=pipeline, stage=stage)
    s = resolve_eval_settings(str(model), flags())
    assert s.conditioning == conditioning and s.stage == stage
    assert f"conditioning {conditioning}" in s.describe()


def test_stage_rule():
    assert stage_saw_reward_tokens("rctp", "rctp") and stage_saw_reward_tokens("rc-grpo", "sft")
    assert stage_saw_reward_tokens("grpo", "rctp") and not stage_saw_reward_tokens("grpo", "sft")
    assert not stage_saw_reward_tokens("sft", "sft")
    with pytest.raises(ValueError, match="eval"):
        stage_saw_reward_tokens("eval", "rctp")


def test_unknown_stage_folder_needs_conditioning(in_tmp):
    model = make_run(in_tmp, stage="rctp-old")
    with pytest.raises(EvalSettingsError, match="pass --conditioning"):
        resolve_eval_settings(str(model), flags())
    s = resolve_eval_settings(str(model), flags(conditioning="low"))
    assert s.conditioning == "low" and s.max_new_tokens == 96


@pytest.mark.parametrize("name, value", [
    ("max_new_tokens", 7), ("max_total_tokens", 5000), ("doc_style", "official"), ("conditioning", "low"),
])
def test_an_explicit_flag_overrides_the_run(in_tmp, name, value):
    model = make_run(in_tmp, "--pipeline", "sft+grpo", stage="sft")
    run_values = {"max_new_tokens": 96, "max_total_tokens": 4096, "doc_style": "compact_no_response",
                  "conditioning": "none"}
    s = resolve_eval_settings(str(model), flags(**{name: value}))
    assert getattr(s, name) == value and s.from_flags == [name]
    for other, expected in run_values.items():
        if other != name:
            assert getattr(s, other) == expected
    assert f"{name} {value} (flag)" in s.describe()


def test_outside_a_run_the_built_in_defaults_apply():
    s = resolve_eval_settings(EMBEDDED, flags())
    assert (s.max_new_tokens, s.max_total_tokens, s.doc_style, s.conditioning) == (512, 8192, "compact", "none")
    assert s.source == "built-in defaults" and s.stage is None
    assert resolve_eval_settings("SomeOwner/some-model", flags()).conditioning == "none"  # a hub id: not fetched
    assert resolve_eval_settings(EMBEDDED, flags(conditioning="high")).conditioning == "high"


def _tokenizer_folder(path: Path, with_reward_tokens: bool) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                  unk_token="[UNK]", eos_token="<eos>")
    if with_reward_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(REWARD_TOKENS)})
    tok.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("with_tokens, conditioning", [(False, "none"), (True, "high")])
def test_a_folder_outside_a_run_is_conditioned_only_if_it_has_the_tokens(tmp_path, with_tokens, conditioning):
    folder = _tokenizer_folder(tmp_path / "models" / "mine", with_tokens)  # models/ but no config.toml above
    s = resolve_eval_settings(str(folder), flags())
    assert s.conditioning == conditioning and s.source == "built-in defaults"
    assert s.max_new_tokens == 512


def test_settings_reach_the_rollouts_and_eval_json(in_tmp, monkeypatch, capsys):
    """main() with the engine and the rollouts faked: the resolved settings are
    what evaluate() gets, the source line is printed, eval.json records them."""
    import rcgrpo.evaluation.rollouts
    import rcgrpo.model.loading
    import rcgrpo.rollout

    model = make_run(in_tmp, "--pipeline", "sft+grpo", stage="grpo")
    seen = {}

    def fake_evaluate(engine, tokenizer, entries, conditioning, settings):
        seen.update(max_new_tokens=settings.max_new_tokens, max_total_tokens=settings.max_total_tokens,
                    doc_style=settings.doc_style, conditioning=conditioning)
        return {"categories": {"base": 0.0}, "overall": 0.0, "n": {"base": len(entries)}, "reward": {"base": 0.0},
                "conditioning": conditioning, "settings": {"conditioning": conditioning,
                                                           "greedy": settings.temperature == 0.0}, "rows": []}

    monkeypatch.setattr(rcgrpo.evaluation.rollouts, "evaluate", fake_evaluate)
    monkeypatch.setattr(rcgrpo.model.loading, "resolve_model_folder", lambda m: Path(m))
    monkeypatch.setattr(rcgrpo.model.loading, "load_tokenizer", lambda folder: None)
    monkeypatch.setattr(rcgrpo.rollout, "make_engine", lambda kind, folder, **kw: seen.setdefault("engine", kw))
    out = in_tmp / "out"
    assert main(["--model", str(model), "--subset", "1", "--categories", "base", "--engine", "vllm",
                 "--max-new-tokens", "12", "--out", str(out)]) == 0
    assert seen == {"engine": {"max_model_len": 4096}, "max_new_tokens": 12, "max_total_tokens": 4096,
                    "doc_style": "compact_no_response", "conditioning": "none"}
    printed = capsys.readouterr().out
    assert ("settings from runs/run/config.toml: max_new_tokens 12 (flag), max_total_tokens 4096, doc_style "
            "compact_no_response, conditioning none (stage grpo of sft+grpo never saw reward tokens)") in printed
    settings = json.loads((out / "eval.json").read_text())["settings"]
    assert settings["source"] == "runs/run/config.toml" and settings["stage"] == "grpo"
    assert settings["max_new_tokens"] == 12 and settings["from_flags"] == ["max_new_tokens"]
    assert settings["conditioning"] == "none" and settings["greedy"] is True


@pytest.mark.parametrize("text, says", [
    ("[eval\nmax_new_tokens = 96\n", "not valid TOML"),
    ("[eval]\nmax_new_tokens = 0\n", "eval.max_new_tokens must be >= 1"),
    ("model = 3\n", "'model' is a section"),
])
def test_a_broken_run_config_is_one_line_naming_it(in_tmp, capsys, text, says):
    model = make_run(in_tmp, stage="rctp")
    (in_tmp / "runs" / "run" / "config.toml").write_text(text)
    with pytest.raises(EvalSettingsError):
        resolve_eval_settings(str(model), flags())
    assert main(["--model", str(model)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "runs/run/config.toml" in err and says in err


@pytest.mark.slow  # the command's entry point in a fresh interpreter (~2.5 s); main's exit codes: above
def test_a_broken_run_config_exits_2_from_the_command_line(in_tmp):
    model = make_run(in_tmp, stage="sft")
    (in_tmp / "runs" / "run" / "config.toml").write_text("not = = toml\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "rcgrpo.eval", "--model", str(model)],
                          capture_output=True, text=True, env=env)  # this checkout's rcgrpo, from any folder
    assert proc.returncode == 2, proc.stderr
    assert "runs/run/config.toml" in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_model_folder_is_one_line(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nowhere" in err and "does not exist" in err
