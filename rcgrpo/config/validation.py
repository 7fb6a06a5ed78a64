"""Checking a Config: the limits each field declares (rcgrpo/config/schema.py, `_f`),
by one loop over the schema; then the rules that relate settings, or look
outside the config (the torchrun world, an installed package, files). Every
problem is collected, so that one ConfigError lists them all.

``finalize`` is the last step of every way a Config is made (the command
line, a file, a saved dict): it fills the settings whose none means
"derived", then validates."""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Iterator

from rcgrpo.base.stages import DYNAMIC_SAMPLING_PIPELINES, PAPER_RL_BATCH, PIPELINES
from rcgrpo.conditioning.reward_tokens import default_eval_conditioning
from rcgrpo.config.schema import BFCL, EMBEDDED_MODEL, Config, ConfigError, all_keys, leaves, slug
from rcgrpo.envs.shipped import SHIPPED_ENVIRONMENTS
from rcgrpo.model.hub import is_hub_id
from rcgrpo.run.trackers import TRACKERS, missing

_SIGNS = {"[": ">=", "(": ">", "]": "<=", ")": "<"}


def _bounds(m: dict) -> str:
    """A field's bounds as text: ">= 1", "in [0, 1)"."""
    low = ("[", m["ge"]) if m["ge"] is not None else ("(", m["gt"]) if m["gt"] is not None else None
    high = ("]", m["le"]) if m["le"] is not None else (")", m["lt"]) if m["lt"] is not None else None
    if low and high:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    bracket, bound = low or high
    return f"{_SIGNS[bracket]} {bound}"


def _within(m: dict, v) -> bool:
    return ((m["ge"] is None or v >= m["ge"]) and (m["gt"] is None or v > m["gt"])
            and (m["le"] is None or v <= m["le"]) and (m["lt"] is None or v < m["lt"]))


def _not_finite(value: Any) -> bool:
    # inf and nan pass most range checks (and 1e400 parses as inf).
    return isinstance(value, float) and not math.isfinite(value)


def _empty_text(value: Any) -> bool:
    # No text setting means anything when empty (a name, a path, a choice):
    # "" is a mistake (an unset shell variable), never "the default".
    return isinstance(value, str) and not value.strip()


def _field_problems(key: str, m: dict, value: Any, name: str = "") -> list[str]:
    """What in `value` breaks the limits in its field's metadata `m`; the
    messages call it `name` (a tool's flag) when given, else `key`."""
    items, key = key.rsplit(".", 1)[-1], name or key
    if value is None:
        return []
    if _not_finite(value):
        return [f"{key} must be a finite number, got {value}"]
    note, choices, out = f" ({m['note']})" if m["note"] else "", m["choices"], []
    if _empty_text(value):
        return [f"{key} must not be an empty string (leave the setting out for its default)"]
    if isinstance(value, list) and any(map(_empty_text, value)):
        return [f"{key} has an empty item: {value}"]
    if isinstance(value, list):
        bad = [v for v in value if choices and v not in choices]
        if bad:  # the key names its items: "data.categories: unknown categories ['web']"
            out.append(f"{key}: unknown {items} {bad}; known: {list(choices)}")
        if m["nonempty"] and not value:
            out.append(f"{key} must not be empty{note}")
        if m["unique"] and len(set(value)) != len(value):
            out.append(f"{key} has duplicates: {value}")
    elif choices and value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        out.append(f"{key} must be one of {choices}, got {value!r}{hint}")
    elif not _within(m, value):
        out.append(f"{key} must be {_bounds(m)}{note}, got {value}")
    return out


def setting_problems(key: str, value: Any, name: str = "") -> list[str]:
    """What in `value` breaks the limits of the setting `key` (a dotted key of
    the schema), called `name` in the messages: the check for a tool's flag
    that stands for a setting."""
    return _field_problems(key, _FIELDS[key], value, name)


_FIELDS = {key: f.metadata for key, f, _, _ in leaves(Config())}


# The rules relating settings. Each yields its messages, each starting with
# the key it is about: `validate` drops those about a setting that is already
# reported as not finite (nan compares false with everything) or empty.


def _model_rules(cfg: Config) -> Iterator[str]:
    m = cfg.model
    if m.dtype == "float16":
        yield ("model.dtype float16 is not supported for training (its gradients underflow without loss "
               "scaling); use bfloat16")
    if m.attn_implementation == "flash_attention_2" and cfg.run.device == "cpu":
        yield "model.attn_implementation flash_attention_2 needs run.device cuda"
    if m.lora.enabled and importlib.util.find_spec("peft") is None:
        yield "model.lora.enabled needs the `peft` package: pip install peft==0.21.2 (or pip install 'rcgrpo[lora]')"


def _batch_rules(cfg: Config) -> Iterator[str]:
    g, d = cfg.grpo, cfg.data
    if g.max_total_tokens <= d.max_prompt_tokens:
        yield f"grpo.max_total_tokens ({g.max_total_tokens}) must exceed data.max_prompt_tokens ({d.max_prompt_tokens})"
    if g.batch_size is not None and g.mini_batches > g.batch_size:
        yield (f"grpo.mini_batches ({g.mini_batches}) must not exceed grpo.batch_size ({g.batch_size}): "
               "a mini-batch holds whole groups")


def _pipeline_rules(cfg: Config) -> Iterator[str]:
    run = cfg.run
    if run.pipeline in DYNAMIC_SAMPLING_PIPELINES and cfg.grpo.dynamic_sampling is False:
        yield f"grpo.dynamic_sampling false contradicts the pipeline {run.pipeline} (GRPO with dynamic sampling)"
    allowed = PIPELINES.get(run.pipeline)  # an unknown pipeline is run.pipeline's own problem
    bad = [x for x in run.stages or [] if allowed and x not in allowed]
    if bad:
        yield f"run.stages: {bad} not in pipeline {run.pipeline} (its stages: {list(allowed)})"


def _run_rules(cfg: Config) -> Iterator[str]:
    name = cfg.run.name
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        yield f"run.name must be a plain folder name, got {name!r}"
    unknown = [k for k in cfg.run.accept_changes or [] if k not in all_keys(cfg)]
    if unknown:
        yield f"run.accept_changes: {unknown} are not settings"
    repo = cfg.run.push_to_hub
    if repo is not None and not (is_hub_id(repo) and "@" not in repo):
        yield f"run.push_to_hub must be a Hub repo id owner/name, got {repo!r}"
    for name in missing(cfg.run.report_to or []):
        others = [t for t in cfg.run.report_to if t != name]
        yield (f"run.report_to {name} needs the `{TRACKERS[name]}` package: pip install {TRACKERS[name]}, or "
               f"--run.report_to {','.join(others) or 'none'}")


def _world_rules(cfg: Config) -> Iterator[str]:
    """Settings that depend on the torchrun world (WORLD_SIZE, read from the
    environment so that a bad launch fails before any model loads)."""
    run = cfg.run
    world = os.environ.get("WORLD_SIZE", "1")
    world = int(world) if world.isdigit() else 1
    if run.engine_tp_size > 1:
        if not (run.engine == "vllm" and run.device == "cuda"):
            yield (f"run.engine_tp_size {run.engine_tp_size} needs run.engine vllm and run.device cuda "
                   "(tensor-parallel engines are vLLM on GPUs)")
        if world % run.engine_tp_size:
            yield f"run.engine_tp_size {run.engine_tp_size} must divide the torchrun world size {world}"
    if world > 1 and cfg.model.lora.enabled:
        yield f"model.lora.enabled is single-process only; this torchrun job has {world} ranks"
    if world > 1 and cfg.grpo.dynamic_sampling:
        yield f"grpo.dynamic_sampling is single-process only; this torchrun job has {world} ranks"


def _missing_files(cfg: Config) -> Iterator[str]:
    src = cfg.model.name_or_path
    if src.startswith("embedded:"):
        if src != EMBEDDED_MODEL:
            yield f"model.name_or_path: unknown embedded model {src!r}; the only one is {EMBEDDED_MODEL!r}"
    else:
        local = Path(src).expanduser()
        looks_local = not is_hub_id(src)  # the rule rcgrpo.model.loading follows
        if local.exists():
            if not local.is_dir():
                yield f"model.name_or_path: {src} is not a folder"
            elif not (local / "config.json").is_file():
                yield f"model.name_or_path: {src} has no config.json (not a Hugging Face model folder)"
        elif looks_local:
            yield f"model.name_or_path: model folder {src} does not exist"
    for key in ("dataset", "eval_dataset"):
        path = getattr(cfg.env, key)
        if path is not None and not Path(path).expanduser().is_file():
            yield f"env.{key}: {path} {'is a folder, not a file' if Path(path).is_dir() else 'does not exist'}"
    if cfg.rctp.data_file is not None and not Path(cfg.rctp.data_file).expanduser().is_file():
        yield f"rctp.data_file: {cfg.rctp.data_file} does not exist"


def _env_rules(cfg: Config) -> Iterator[str]:
    env = cfg.env
    if env.name != BFCL and env.name not in SHIPPED_ENVIRONMENTS and ":" not in env.name:  # python:NAME too
        yield (f"env.name {env.name!r}: {BFCL}, one of the shipped environments {list(SHIPPED_ENVIRONMENTS)}, or "
               "module:attr naming an environment_factory")
    if env.reward_range is not None and (len(env.reward_range) != 2 or env.reward_range[0] >= env.reward_range[1]):
        yield f"env.reward_range must be [low, high] with low < high, got {env.reward_range}"
    if cfg.rctp.expert_model is not None and cfg.rctp.expert_source != "rollouts":
        yield "rctp.expert_model names a model whose rollouts are the experts: it needs rctp.expert_source rollouts"
    if env.name == BFCL and (env.tools or env.reward_funcs or env.dataset or env.eval_dataset):
        yield "env.tools, env.reward_funcs, env.dataset and env.eval_dataset need an environment other than bfcl"


RULES = (_model_rules, _batch_rules, _pipeline_rules, _run_rules, _world_rules, _env_rules)


def _unusable(value: Any) -> bool:
    """Not finite, an empty text, or a list holding one: the setting's own
    problem, which the rules relating it to others would only repeat."""
    if isinstance(value, list):
        return any(map(_unusable, value))
    return _not_finite(value) or _empty_text(value)


def validate(cfg: Config, check_files: bool = True) -> None:
    """Raise one ConfigError listing every problem found."""
    problems, unusable = [], set()
    for key, f, _, value in leaves(cfg):
        problems.extend(_field_problems(key, f.metadata, value))
        if _unusable(value):
            unusable.add(key)
    for rule in RULES + ((_missing_files,) if check_files else ()):
        problems.extend(p for p in rule(cfg) if p.split(" ", 1)[0].rstrip(":") not in unusable)
    if problems:
        head = problems[0] if len(problems) == 1 else f"{len(problems)} problems:\n  - " + "\n  - ".join(problems)
        raise ConfigError(f"invalid configuration: {head}", problems)


def finalize(cfg: Config, check_files: bool = True) -> Config:
    """Fill the 'none = derived' settings, then validate everything."""
    if cfg.run.pipeline in PIPELINES:
        if cfg.run.name is None:
            cfg.run.name = slug(cfg.run.pipeline)
        if cfg.grpo.batch_size is None:
            cfg.grpo.batch_size = PAPER_RL_BATCH[cfg.rl_stage]
        if cfg.eval.conditioning == "auto":
            # Only a pipeline that trained on reward tokens can use one.
            cfg.eval.conditioning = default_eval_conditioning(cfg.finetune_stage, cfg.rl_stage)
        if cfg.grpo.dynamic_sampling is None:
            cfg.grpo.dynamic_sampling = cfg.run.pipeline in DYNAMIC_SAMPLING_PIPELINES
    validate(cfg, check_files=check_files)
    return cfg
