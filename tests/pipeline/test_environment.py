"""Which environment a run plays (rcgrpo/pipeline/environment.py): BFCL, a
shipped one, or the user's, from the Python trainer's objects or import
strings on the command line; references checked before any model loads; and
one rule for defaults in Python and on the command line."""
import json

import pytest

from rcgrpo.base.errors import UserError
from rcgrpo.config.cli import resolve
from rcgrpo.config.schema import ConfigError
from rcgrpo.envs.tasks import TaskDataError
from rcgrpo.pipeline.environment import UserEnvironment, import_object, run_environment
from rcgrpo.pipeline.prepare import training_entries
from rcgrpo.trainer import RCGRPOConfig, RCGRPOTrainer


class Counter:
    def reset(self, target=0, **row):
        self.total, self.target = 0, target

    def add(self, amount: int) -> str:
        """Add to the running total.

        Args:
            amount: how much to add
        """
        self.total += amount
        return f"total={self.total}"

    def get_reward(self) -> float:
        return float(self.total == self.target)


def bonus(prompts, completions, target, **kwargs):
    return [0.0 for _ in prompts]


def row(target, amounts, **extra):
    completion = [m for a in amounts for m in (
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                             "function": {"name": "add", "arguments": a}}]},
        {"role": "tool", "name": "add", "content": "?"})] + [{"role": "assistant", "content": "done"}]
    return {"prompt": f"Reach {target}.", "target": target, "completion": completion, **extra}


def test_the_environment_comes_from_objects_strings_or_the_shipped_list(tmp_path):
    assert run_environment(resolve([]).cfg).is_bfcl
    given = run_environment(resolve(["--env", f"{__name__}:Counter"]).cfg,
                            UserEnvironment(Counter, train_dataset=[row(1, [{"amount": 1}])]))
    assert given.description == "python:Counter" and list(given.tool_env.specs) == ["add"]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row(2, [{"amount": 2}])) + "\n")
    cfg = resolve(["--env", f"{__name__}:Counter", "--dataset", str(path), "--reward-funcs",
                   f"{__name__}:bonus", "--env.success_threshold", "0.5"]).cfg
    from_strings = run_environment(cfg)
    assert from_strings.tool_env.reward_funcs == [bonus] and from_strings.train_source == str(path)
    assert from_strings.tool_env.success_threshold == 0.5


@pytest.mark.slow  # reasoning-gym builds 3,600 tasks (~3 s)
def test_the_shipped_environment_has_a_held_out_split():
    shipped = run_environment(resolve(["--env", "arithmetic"]).cfg)
    train, test = shipped.train_source, shipped.eval_source
    assert len(train) >= 2000 and len(test) >= 500
    assert not {r["id"] for r in train} & {r["id"] for r in test}


@pytest.mark.parametrize("spec,expect", [("nocolon", "is not module:attr"),
                                         ("no_such_module_x:f", "cannot import 'no_such_module_x'"),
                                         (f"{__name__}:Nope", "has no attribute 'Nope'")])
def test_an_import_string_that_fails_is_one_line(spec, expect):
    with pytest.raises(UserError, match=expect) as info:
        import_object(spec, "env.name")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad,expect", [
    (row(5, [{"amount": "five"}]), "completion: a call does not run: Error: argument 'amount' must be integer"),
    (row(5, [{"amount": 2}]), "completion: its calls earn reward 0, below env.success_threshold 1"),
    (row(5, [{"amount": 5, "extra": 1}]), "unknown argument"),
])
def test_a_reference_that_fails_stops_the_run_before_any_model_loads(tokenizer, bad, expect):
    cfg = resolve(["--env", f"{__name__}:Counter"]).cfg
    environment = run_environment(cfg, UserEnvironment(Counter, train_dataset=[row(3, [{"amount": 3}]), bad]))
    environment.tool_env.bind(tokenizer)
    with pytest.raises(TaskDataError) as info:
        training_entries(cfg, tokenizer, environment)
    assert str(info.value).startswith("train_dataset row 1 (id 'train_dataset-1'): ") and expect in str(info.value)
    good = run_environment(cfg, UserEnvironment(Counter, train_dataset=[row(3, [{"amount": 1}, {"amount": 2}])]))
    good.tool_env.bind(tokenizer)
    assert [t.id for t in training_entries(cfg, tokenizer, good)] == ["train_dataset-0"]


def test_python_and_the_command_line_share_one_rule_for_defaults():
    # No preset named: the default preset, in both.
    assert RCGRPOConfig().to_dict() == resolve([]).cfg.to_dict()
    assert RCGRPOConfig(preset="none").to_dict() == resolve(["--preset", "none"]).cfg.to_dict()
    python = RCGRPOConfig(output_dir="runs/mine", rctp={"epochs": 1}, grpo={"steps": 2, "group_size": 2},
                          **{"run.fused": True})
    cli = resolve(["--out-dir", "runs", "--name", "mine", "--rctp.epochs", "1", "--grpo.steps", "2",
                   "--grpo.group_size", "2", "--fused"]).cfg
    assert python.to_dict() == cli.to_dict()


def test_python_settings_are_checked_as_the_command_line_checks_them():
    with pytest.raises(ConfigError, match="did you mean 'grpo.group_size'"):
        RCGRPOConfig(grpo={"groupsize": 2})
    with pytest.raises(ConfigError, match="grpo.group_size"):
        RCGRPOConfig(grpo={"group_size": 1})
    with pytest.raises(ConfigError, match="unknown preset 'big'"):
        RCGRPOConfig(preset="big")
    trainer = RCGRPOTrainer(model="embedded:smollm2-135m-instruct", environment_factory=Counter,
                            train_dataset=[row(1, [{"amount": 1}])])
    assert trainer.args.model.name_or_path == "embedded:smollm2-135m-instruct"
    assert trainer.environment.environment_factory is Counter
    assert trainer.args.env.name == "python:Counter"  # config.toml records what the run played
    with pytest.raises(UserError, match="the Python trainer was given as objects"):
        run_environment(trainer.args)  # a saved run's name is not something to import
