"""Settings for the whole pipeline: dataclasses, a TOML file, CLI overrides.

Layers, later wins::

    dataclass defaults  <-  --preset NAME  <-  --config FILE.toml  <-  CLI flags

Defaults are the paper's numbers where ../shared/PAPER.md gives them (marked
"paper"); everything else is this project's choice and says so. CLI flags are
dotted keys (``--grpo.lr 1e-6``, ``--grpo.lr=1e-6``, ``--model.lora.r 8``;
bools also bare: ``--run.fused`` / ``--no-run.fused``) plus a few shortcuts
(``--fused``, ``--pipeline``, ``--stages``, ``--resume``, ``--name``,
``--model``, ``--out-dir``, ``--device``).

Everything is validated here, before any model or data loads: an unknown key
(with the closest known key suggested), a wrong type, an impossible value or a
missing file raises ``ConfigError`` naming the setting.

``python -m rcgrpo.config [flags]`` prints the resolved configuration as TOML.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from rcgrpo.atomic import atomic_write_text
from rcgrpo.errors import UserError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser under its PyPI name
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "ConfigError", "Config", "ModelConfig", "LoraConfig", "DataConfig", "RctpConfig", "SftConfig",
    "GrpoConfig", "EvalConfig", "RunConfig", "PIPELINES", "PRESETS", "parse_args", "load_config",
]

# Kept in sync with rcgrpo.models.EMBEDDED by a test; not imported, so that
# validating a config does not import torch.
EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
# Kept in sync with kernels.packing.LOSS_TYPES by a test.
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
ADVANTAGE_SCALES = ("group", "none")
DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")
DEVICES = ("auto", "cpu", "cuda")
ENGINES = ("auto", "vllm", "hf")
DOC_STYLES = ("compact", "compact_no_response", "official")
CONDITIONING = ("auto", "high", "low", "none")
SEED_MAX = 2**32 - 1  # numpy.random.seed's upper bound

# Each pipeline is a row of the paper's Table 1/3; its stages run in order and
# each reads the previous one's checkpoint. "rctp-data" builds the labelled
# expert + failure trajectories; "sft" builds its expert-only data itself.
PIPELINES: dict[str, tuple[str, ...]] = {
    "rctp+rc-grpo": ("rctp-data", "rctp", "rc-grpo", "eval"),
    "rctp+grpo": ("rctp-data", "rctp", "grpo", "eval"),
    "sft+grpo": ("sft", "grpo", "eval"),
    "sft+rc-grpo": ("sft", "rc-grpo", "eval"),
    # Not in the paper: DAPO's dynamic sampling (zero-variance groups dropped,
    # more prompts drawn) as the competing remedy for vanishing advantages.
    "sft+grpo-ds": ("sft", "grpo", "eval"),
}
# Pipelines whose GRPO stage runs with dynamic sampling (grpo.dynamic_sampling none = on).
DYNAMIC_SAMPLING_PIPELINES = ("sft+grpo-ds",)
RL_STAGES = ("grpo", "rc-grpo")
# The paper's RL batch differs between the methods (PAPER.md table).
PAPER_RL_BATCH = {"rc-grpo": 256, "grpo": 64}


class ConfigError(UserError, ValueError):
    """A setting is unknown, mistyped, impossible, or names a missing file.

    ``problems`` lists every message when validation found several.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = list(problems) or [message]


def _f(default: Any, help: str, resume_safe: bool = False):
    """A dataclass field with its help text (lists get a fresh copy each time).

    ``resume_safe``: changing the setting between a run and its ``--resume``
    changes neither what was trained nor what will be (how often to save,
    what to evaluate, where to run); every other change is refused there.
    """
    meta = {"help": help, "resume_safe": resume_safe}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class LoraConfig:
    """LoRA adapters (rcgrpo/lora.py; needs `peft`, the `lora` extra). The
    engine and the exported stage models get the merged weights."""

    enabled: bool = _f(False, "train LoRA adapters instead of all weights (needs `pip install peft==0.21.2`)")
    r: int = _f(16, "LoRA rank")
    alpha: float = _f(32.0, "LoRA alpha (scale = alpha / r)")
    dropout: float = _f(0.05, "LoRA dropout, in [0, 1)")
    target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "modules that get adapters"
    )


@dataclass
class ModelConfig:
    name_or_path: str = _f(EMBEDDED_MODEL, f"local HF folder, hub id (owner/name), or {EMBEDDED_MODEL}")
    dtype: str = _f(
        "float32",
        f"compute dtype of the matmuls, one of {DTYPES}: bf16/fp16 run under autocast (FSDP2: a mixed-precision "
        "policy); master weights, gradients and AdamW state stay float32 (CPU: float32 is fastest)",
    )
    export_dtype: str = _f(
        "float32",
        f"dtype of each stage's exported model (the next stage's start), one of {DTYPES}; float32 keeps every "
        "update, bfloat16 halves the size and rounds away updates below ~0.4% of a weight",
    )
    attn_implementation: str = _f(
        "auto", f"one of {ATTN_IMPLEMENTATIONS}; auto = flash_attention_2 on CUDA when installed, else sdpa",
        resume_safe=True,
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory", resume_safe=True)
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA settings"})


@dataclass
class DataConfig:
    categories: list[str] = _f(list(CATEGORIES), f"BFCL multi-turn categories, subset of {CATEGORIES}")
    max_prompt_tokens: int = _f(6144, "skip entries whose first prompt is longer (choice: fits an 8k context)")
    train_subset: Optional[int] = _f(None, "use only this many training entries (none = all 720)")
    entry_ids: Optional[list[str]] = _f(
        None, "train only on these training-split entry ids, e.g. multi_turn_base_100 (none = all; then train_subset)"
    )
    seed: int = _f(0, "seed for data order, subsets, reward-token draws and torch")
    doc_style: str = _f("compact", f"function docs in the system prompt, one of {DOC_STYLES} (choice: compact JSON)")


@dataclass
class SftConfig:
    """Supervised fine-tuning on expert trajectories (the SFT baseline)."""

    lr: float = _f(1e-5, "learning rate (paper)")
    batch_size: int = _f(16, "trajectories per optimizer step (paper)")
    epochs: int = _f(2, "epochs over the expert trajectories (paper)")
    weight_decay: float = _f(0.0, "AdamW weight decay (choice)")
    warmup_ratio: float = _f(0.0, "fraction of steps with linear warm-up (choice)")
    max_grad_norm: float = _f(1.0, "gradient clipping norm; 0 = off (choice)")


@dataclass
class RctpConfig(SftConfig):
    """The same fine-tuning on the reward-tagged expert + failure set, plus how
    that set is built (the redeclared `epochs` keeps its place in the order)."""

    epochs: int = _f(5, "epochs over the RCTP set (paper)")
    failure_ratio: float = _f(1.0, "failure : expert trajectories (paper: 1:1)")
    failure_attempts: int = _f(4, "rollouts of the starting model per training entry to find failures (choice)")
    failure_temperature: float = _f(1.0, "sampling temperature of those rollouts (choice)")
    fill_with_perturbed: bool = _f(True, "top up missing failures with perturbed expert trajectories")
    data_file: Optional[str] = _f(None, "reuse this RCTP JSONL instead of building it (must exist)")


@dataclass
class GrpoConfig:
    """GRPO and RC-GRPO share these; the pipeline decides whether rollouts are
    reward-conditioned."""

    lr: float = _f(1e-6, "learning rate (paper)")
    batch_size: Optional[int] = _f(
        None, "prompts per step; none = the paper's batch: 256 for rc-grpo, 64 for grpo"
    )
    group_size: int = _f(5, "rollouts per prompt, G (paper)")
    steps: int = _f(400, "optimizer steps (the paper's 'epochs' column: 400)")
    beta: float = _f(0.1, "KL coefficient to the frozen reference (paper)")
    eps_low: float = _f(0.2, "clip range below 1 (paper)")
    eps_high: float = _f(0.2, "clip range above 1 (paper)")
    p_high: float = _f(0.5, "RC-GRPO: P(<|high_reward|>) per rollout (paper)")
    temperature: float = _f(1.0, "rollout sampling temperature (choice)")
    top_p: float = _f(1.0, "rollout nucleus sampling (choice)")
    max_new_tokens: int = _f(512, "max tokens per assistant step (choice)")
    max_total_tokens: int = _f(8192, "max tokens of a whole trajectory (choice: the small model's context)")
    loss_type: str = _f("grpo", f"loss normalisation, one of {LOSS_TYPES}")
    advantage_scale: str = _f("group", f"one of {ADVANTAGE_SCALES}: divide by the group std or not")
    updates_per_batch: int = _f(
        1, "PPO epochs (mu): passes over each rollout batch; > 1 computes the trainer's old log-probs once "
        "before the first update, and the clip then acts (choice: 1, on-policy)")
    mini_batches: int = _f(
        1, "optimizer steps per pass: the batch's groups are split into this many mini-batches (choice: 1)")
    tis_cap: Optional[float] = _f(
        None, "truncated importance sampling (Yao et al. 2025): each token's loss weighted by "
        "min(exp(logp_old_trainer - logp_engine), cap), no gradient through it; none = off")
    loss_over_informative_groups: bool = _f(
        False, "the loss (and its normaliser) covers only groups with non-zero advantage; zero-variance groups, "
        "KL term included, are left out")
    dynamic_sampling: Optional[bool] = _f(
        None, "DAPO dynamic sampling: drop zero-variance groups and draw more prompts in the same step until "
        "batch_size informative groups (or max_draws); none = on for the sft+grpo-ds pipeline only")
    dynamic_sampling_max_draws: int = _f(
        4, "dynamic sampling: rollout rounds per step at most, the scheduled prompts' round included")
    weight_decay: float = _f(0.0, "AdamW weight decay (choice)")
    max_grad_norm: float = _f(1.0, "gradient clipping norm; 0 = off (choice)")


@dataclass
class EvalConfig:
    split: str = _f("test", "test (80 entries) or train", resume_safe=True)
    subset: Optional[int] = _f(None, "evaluate only this many entries (none = the whole split)", resume_safe=True)
    categories: list[str] = _f(list(CATEGORIES), "categories to evaluate", resume_safe=True)
    greedy: bool = _f(True, "greedy decoding (else sample at grpo.temperature)", resume_safe=True)
    conditioning: str = _f(
        "auto", f"reward token in the prompt, one of {CONDITIONING}; auto = high for reward-conditioned pipelines",
        resume_safe=True,
    )
    max_new_tokens: int = _f(512, "max tokens per assistant step", resume_safe=True)


@dataclass
class RunConfig:
    name: Optional[str] = _f(None, "run name: the run lives in out_dir/name (none = the pipeline's name)")
    out_dir: str = _f("runs", "parent folder of runs")
    pipeline: str = _f("rctp+rc-grpo", f"one of {tuple(PIPELINES)}")
    stages: Optional[list[str]] = _f(None, "run only these stages of the pipeline (none = all)", resume_safe=True)
    fused: bool = _f(False, "fused linear+loss kernels (Triton on CUDA, chunked on CPU)", resume_safe=True)
    resume: bool = _f(False, "continue the run from its latest good checkpoint", resume_safe=True)
    checkpoint_every: int = _f(
        50, "optimizer steps between checkpoints; 0 = only at the end of a stage", resume_safe=True
    )
    keep_last: int = _f(3, "checkpoints kept per stage", resume_safe=True)
    micro_batch_tokens: int = _f(8192, "tokens per packed micro-batch", resume_safe=True)
    grad_accum: int = _f(0, "micro-batches per optimizer step; 0 = as many as one batch needs")
    device: str = _f("auto", f"one of {DEVICES}", resume_safe=True)
    engine: str = _f("auto", f"rollout engine, one of {ENGINES} (auto: vLLM when installed)", resume_safe=True)
    engine_tp_size: int = _f(
        1, "torchrun: ranks per tensor-parallel vLLM engine (1 = an engine per rank); divides the world size",
        resume_safe=True,
    )
    engine_memory_fraction: float = _f(
        0.5, "CUDA: share of the GPU's memory the vLLM engine takes while awake (it sleeps during updates)",
        resume_safe=True,
    )
    dist_timeout_s: float = _f(
        1800.0, "torchrun: seconds a collective waits for a peer before failing (bounds a hang on a dead rank)",
        resume_safe=True,
    )
    log_every: int = _f(1, "steps between metric lines", resume_safe=True)
    tensorboard: bool = _f(True, "also write TensorBoard scalars when it is installed", resume_safe=True)
    accept_changes: Optional[list[str]] = _f(
        None, "--resume: settings whose change from the saved run is accepted anyway (recorded in the run's "
        "config_changes.jsonl); e.g. grpo.lr,grpo.steps", resume_safe=True,
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rctp: RctpConfig = field(default_factory=RctpConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preset: Optional[str] = field(default=None, metadata={"help": "named preset applied first"})

    # ---- derived views, so callers need not re-derive pipeline facts
    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / str(self.run.name or _slug(self.run.pipeline))

    @property
    def stages(self) -> list[str]:
        """The stages to run, in pipeline order."""
        all_stages = PIPELINES[self.run.pipeline]
        wanted = self.run.stages or list(all_stages)
        return [s for s in all_stages if s in wanted]

    @property
    def finetune_stage(self) -> str:
        return "rctp" if self.run.pipeline.startswith("rctp") else "sft"

    @property
    def rl_stage(self) -> str:
        return next(s for s in PIPELINES[self.run.pipeline] if s in RL_STAGES)

    @property
    def reward_conditioned(self) -> bool:
        """RL rollouts draw a reward token per rollout (rc-grpo)."""
        return self.rl_stage == "rc-grpo"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return _to_toml(self.to_dict())

    def save(self, run_dir: str | os.PathLike | None = None) -> Path:
        """Write config.toml and config.json into the run dir (atomically)."""
        d = Path(run_dir) if run_dir is not None else self.run_dir
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / "config.toml", self.to_toml())
        atomic_write_text(d / "config.json", json.dumps(self.to_dict(), indent=2) + "\n")
        return d / "config.toml"

    @classmethod
    def from_dict(cls, d: dict, source: str = "dict", check_files: bool = True) -> "Config":
        """Defaults overlaid with ``d`` (nested sections, e.g. a checkpoint's
        run_config.json), then validated."""
        cfg = cls()
        _apply_nested(cfg, d, f"in {source}")
        return finalize(cfg, check_files=check_files)


PRESETS: dict[str, dict[str, Any]] = {
    # The embedded CPU run (`make train`, <= 20 min on 2 cores). Starting
    # values; the trainer's owner tunes them.
    "cpu-small": {
        "data.categories": ["base"],
        "data.train_subset": 4,
        "data.max_prompt_tokens": 2600,
        "data.doc_style": "compact_no_response",
        "rctp.batch_size": 4,
        "rctp.epochs": 1,
        "rctp.failure_attempts": 1,
        "sft.batch_size": 4,
        "sft.epochs": 1,
        "grpo.batch_size": 1,
        "grpo.group_size": 4,
        "grpo.steps": 2,
        "grpo.max_new_tokens": 96,
        "grpo.max_total_tokens": 4096,
        "eval.subset": 2,
        "eval.categories": ["base"],
        "eval.max_new_tokens": 96,
        "run.micro_batch_tokens": 4096,
        "run.checkpoint_every": 1,
        "run.keep_last": 2,
    },
    # The paper's setting on GPUs (Qwen2.5-7B-Instruct); numbers from PAPER.md.
    "paper-qwen7b": {
        "model.name_or_path": "Qwen/Qwen2.5-7B-Instruct",
        "model.dtype": "bfloat16",
        "model.gradient_checkpointing": True,
        "data.max_prompt_tokens": 16384,
        "grpo.max_total_tokens": 32768,
        "run.micro_batch_tokens": 32768,
        "run.device": "cuda",
    },
}

# Shortcut flags -> dotted keys.
ALIASES = {
    "fused": "run.fused",
    "pipeline": "run.pipeline",
    "stages": "run.stages",
    "resume": "run.resume",
    "name": "run.name",
    "model": "model.name_or_path",
    "out-dir": "run.out_dir",
    "device": "run.device",
}


# ------------------------------------------------------------------ parsing


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _fields(obj) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(type(obj))
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(obj)}


def _leaves(obj, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any, Any]]:
    """(dotted key, field, type, value) of every setting, in declaration order."""
    for name, (f, tp) in _fields(obj).items():
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, prefix + name + ".")
        else:
            yield prefix + name, f, tp, value


def all_keys(cfg: Optional[Config] = None) -> dict[str, tuple[Any, str]]:
    """Every dotted key -> (type, help), in declaration order."""
    return {key: (tp, f.metadata.get("help", "")) for key, f, tp, _ in _leaves(cfg or Config())}


def flat_values(cfg: Config) -> dict[str, Any]:
    """Every dotted key -> its value in `cfg`."""
    return {key: value for key, _, _, value in _leaves(cfg)}


def resume_safe_keys() -> frozenset[str]:
    """The dotted keys whose fields say `resume_safe` (see `_f`); and the
    preset name, whose effect shows in the values it set."""
    return frozenset({key for key, f, _, _ in _leaves(Config()) if f.metadata.get("resume_safe")} | {"preset"})


# The paper's symbols and other trainers' names for our settings, so that a
# reader who types them is pointed at the right key.
SYNONYMS = {
    "g": "group_size", "num_generations": "group_size", "n_samples": "group_size",
    "kl_coef": "beta", "kl_beta": "beta", "eps": "eps_low", "epsilon": "eps_low", "clip_eps": "eps_low",
    "p": "p_high", "learning_rate": "lr", "bs": "batch_size", "epoch": "epochs",
}


def _unknown(key: str, known: Sequence[str], where: str) -> ConfigError:
    head, _, last = key.rpartition(".")
    syn = SYNONYMS.get(last.lower())
    if syn:
        candidate = f"{head}.{syn}" if head else syn
        if candidate in known:
            return ConfigError(f"unknown setting {key!r} ({where}); did you mean {candidate!r}?")
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    # A bare field name ("lr") is most likely meant inside some section.
    if not close:
        close = [k for k in known if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]][:3]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(f"unknown setting {key!r} ({where}){hint}")


def _optional_inner(tp):
    """X for Optional[X], else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return None


def _type_name(tp) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_type_name(inner)} or none"
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _from_text(text: str, tp, key: str):
    """A CLI string converted to the field's type."""
    inner = _optional_inner(tp)
    if inner is not None:
        if text.strip().lower() in ("none", "null", ""):
            return None
        return _from_text(text, inner, key)
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
    elif tp is int:
        try:
            return int(text)
        except ValueError:
            pass
    elif tp is float:
        try:
            return float(text)
        except ValueError:
            pass
    elif tp is str:
        return text
    elif typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        return [_from_text(p.strip(), item, key) for p in text.split(",") if p.strip()]
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {text!r}")


def _check_value(value, tp, key: str, where: str):
    """A TOML/dict value checked (and int->float widened) against the field type."""
    inner = _optional_inner(tp)
    if inner is not None:
        # TOML has no null: the string "none" spells it (what save() writes).
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        return _check_value(value, inner, key, where)
    ok = False
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    elif typing.get_origin(tp) is list:
        if isinstance(value, (list, tuple)):
            item = typing.get_args(tp)[0]
            return [_check_value(v, item, key, where) for v in value]
    if not ok:
        raise ConfigError(f"{key} ({where}): expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _set(cfg: Config, key: str, value, where: str, from_text: bool) -> None:
    keys = all_keys(cfg)
    if key not in keys:
        raise _unknown(key, keys, where)
    tp = keys[key][0]
    value = _from_text(value, tp, key) if from_text else _check_value(value, tp, key, where)
    *path, last = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, last, value)


def _apply_nested(cfg: Config, d: dict, where: str, prefix: str = "") -> None:
    for k, v in d.items():
        key = prefix + str(k)
        if isinstance(v, dict):
            known = all_keys(cfg)
            if not any(x.startswith(key + ".") for x in known):
                raise _unknown(key, [x.rsplit(".", 1)[0] for x in known] + list(known), where)
            _apply_nested(cfg, v, where, key + ".")
        elif any(x.startswith(key + ".") for x in all_keys(cfg)):
            raise ConfigError(f"{key!r} is a section ({where}): write [{key}] with its settings, "
                              f"not {key} = {v!r}")
        else:
            _set(cfg, key, v, where, from_text=False)


def _apply_preset(cfg: Config, name: str, where: str) -> None:
    if name not in PRESETS:
        raise _unknown(name, list(PRESETS), f"{where}: presets are {', '.join(PRESETS)}")
    for key, value in PRESETS[name].items():
        _set(cfg, key, value, f"preset {name}", from_text=False)
    cfg.preset = name


def load_toml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from e


def _split_argv(argv: Sequence[str]) -> list[tuple[str, Optional[str], str]]:
    """argv -> [(key, text value or None for a bare flag, original flag)]."""
    out = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: settings are given as --key value")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = body, argv[i + 1]
            i += 1
        else:
            key, value = body, None
        out.append((key, value, arg))
        i += 1
    return out


def usage() -> str:
    lines = [
        "usage: python -m rcgrpo.train [--config FILE.toml] [--preset NAME] [--key value ...]",
        "",
        "shortcuts: " + ", ".join(f"--{a} (= --{k})" for a, k in ALIASES.items()),
        f"presets: {', '.join(PRESETS)}",
        "bools: --key, --key true/false, --no-key",
        "errors are one line (exit code 2); --debug (or RCGRPO_DEBUG=1) shows tracebacks",
        "",
        "settings (defaults):",
    ]
    defaults = Config()
    for key, (tp, help) in all_keys().items():
        obj = defaults
        for p in key.split("."):
            obj = getattr(obj, p)
        lines.append(f"  --{key} {_type_name(tp).upper().replace(' ', '_')}  [{obj!r}]  {help}")
    return "\n".join(lines)


DEFAULT_PRESET = "cpu-small"


def _names_a_model(flags, file_data: dict) -> bool:
    from_flags = any(ALIASES.get(k, k) == "model.name_or_path" for k, _, _ in flags)
    model = file_data.get("model")
    # A non-table `model = ...` is reported by _apply_nested, naming the key.
    return from_flags or (isinstance(model, dict) and "name_or_path" in model)


def parse_args(argv: Optional[Sequence[str]] = None, *, check_files: bool = True) -> Config:
    """Build the validated Config from defaults, preset, TOML file and flags.

    ``--help`` prints every setting and exits (SystemExit 0). Any problem
    raises ConfigError before anything heavy happens. ``check_files=False``
    skips the existence checks (for tests and tools that only inspect).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        raise SystemExit(0)
    flags = _split_argv(argv)
    known = all_keys()

    cfg = Config()
    preset = [v for k, v, _ in flags if k == "preset"]
    files = [v for k, v, _ in flags if k == "config"]
    for name, vals in (("--preset", preset), ("--config", files)):
        if any(v is None for v in vals):
            raise ConfigError(f"{name} needs a value")
        if len(vals) > 1:
            raise ConfigError(f"{name} given {len(vals)} times")
    file_data = load_toml(files[0]) if files else {}
    # A preset named in the file applies first too; the CLI preset wins.
    file_preset = file_data.pop("preset", None)
    chosen = preset[0] if preset else file_preset
    if chosen is None and not _names_a_model(flags, file_data):
        # The embedded 135M model is the CPU default: `python -m rcgrpo.train
        # --fused` alone runs the run sized for this machine (`--preset none`
        # gives the paper-sized defaults instead).
        chosen = DEFAULT_PRESET
    if chosen not in (None, "none"):
        _apply_preset(cfg, chosen, "--preset" if preset else f"{files[0] if file_preset else 'default preset'}")
    if files:
        _apply_nested(cfg, file_data, f"in {files[0]}")

    for key, value, flag in flags:
        if key in ("preset", "config"):
            continue
        negated = False
        if key.startswith("no-") and value is None:
            key, negated = key[3:], True
        key = ALIASES.get(key, key)
        if key not in known:
            raise _unknown(key, list(known) + [f"{a}" for a in ALIASES], f"flag {flag}")
        tp = known[key][0]
        if value is None:
            if tp is not bool:
                raise ConfigError(f"{flag} needs a value ({_type_name(tp)})")
            value = "false" if negated else "true"
        _set(cfg, key, value, f"flag {flag}", from_text=True)
    return finalize(cfg, check_files=check_files)


def load_config(path: str | os.PathLike, *, check_files: bool = True) -> Config:
    """A saved config.toml (e.g. a run's) as a validated Config."""
    return parse_args(["--config", str(path)], check_files=check_files)


# --------------------------------------------------------------- validation


def finalize(cfg: Config, check_files: bool = True) -> Config:
    """Fill the 'none = derived' settings, then validate everything."""
    if cfg.run.pipeline in PIPELINES:
        if cfg.run.name is None:
            cfg.run.name = _slug(cfg.run.pipeline)
        if cfg.grpo.batch_size is None:
            cfg.grpo.batch_size = PAPER_RL_BATCH[cfg.rl_stage]
        if cfg.eval.conditioning == "auto":
            # Only a pipeline that trained on reward tokens can use one.
            cfg.eval.conditioning = "none" if (cfg.finetune_stage, cfg.rl_stage) == ("sft", "grpo") else "high"
        if cfg.grpo.dynamic_sampling is None:
            cfg.grpo.dynamic_sampling = cfg.run.pipeline in DYNAMIC_SAMPLING_PIPELINES
    validate(cfg, check_files=check_files)
    return cfg


def validate(cfg: Config, check_files: bool = True) -> None:
    """Raise one ConfigError listing every problem found."""
    problems: list[str] = []
    # inf and nan pass most range checks (and 1e400 parses as inf): every
    # float setting is checked first, and its other checks are then skipped.
    values = flat_values(cfg)
    not_finite = sorted(k for k, v in values.items() if isinstance(v, float) and not math.isfinite(v))
    problems.extend(f"{k} must be a finite number, got {values[k]}" for k in not_finite)

    def need(cond: bool, msg: str) -> None:
        if not cond and msg.split(" ", 1)[0].rstrip(":") not in not_finite:
            problems.append(msg)

    m, d, r, s, g, e, run = cfg.model, cfg.data, cfg.rctp, cfg.sft, cfg.grpo, cfg.eval, cfg.run
    need(m.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {m.dtype!r}")
    need(m.dtype != "float16", "model.dtype float16 is not supported for training (its gradients underflow "
         "without loss scaling); use bfloat16")
    need(m.export_dtype in DTYPES, f"model.export_dtype must be one of {DTYPES}, got {m.export_dtype!r}")
    need(m.attn_implementation in ATTN_IMPLEMENTATIONS,
         f"model.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {m.attn_implementation!r}")
    need(not (m.attn_implementation == "flash_attention_2" and run.device == "cpu"),
         "model.attn_implementation flash_attention_2 needs run.device cuda")
    lo = m.lora
    need(lo.r >= 1, f"model.lora.r must be >= 1, got {lo.r}")
    need(lo.alpha > 0, f"model.lora.alpha must be > 0, got {lo.alpha}")
    need(0 <= lo.dropout < 1, f"model.lora.dropout must be in [0, 1), got {lo.dropout}")
    need(bool(lo.target_modules), "model.lora.target_modules must not be empty")
    if lo.enabled:
        need(importlib.util.find_spec("peft") is not None,
             "model.lora.enabled needs the `peft` package: pip install peft==0.21.2 (or pip install 'rcgrpo[lora]')")

    for key, cats in (("data.categories", d.categories), ("eval.categories", e.categories)):
        bad = [c for c in cats if c not in CATEGORIES]
        need(not bad, f"{key}: unknown categories {bad}; known: {list(CATEGORIES)}")
        need(bool(cats), f"{key} must not be empty")
        need(len(set(cats)) == len(cats), f"{key} has duplicates: {cats}")
    need(d.max_prompt_tokens >= 1, f"data.max_prompt_tokens must be >= 1, got {d.max_prompt_tokens}")
    need(d.train_subset is None or d.train_subset >= 1, f"data.train_subset must be >= 1, got {d.train_subset}")
    need(0 <= d.seed <= SEED_MAX, f"data.seed must be in [0, {SEED_MAX}] (numpy's seed range), got {d.seed}")
    need(d.entry_ids is None or (len(d.entry_ids) >= 1 and len(set(d.entry_ids)) == len(d.entry_ids)),
         f"data.entry_ids must be a non-empty list without repeats, got {d.entry_ids}")

    for name, st in (("rctp", r), ("sft", s)):
        need(st.lr > 0, f"{name}.lr must be > 0, got {st.lr}")
        need(st.batch_size >= 1, f"{name}.batch_size must be >= 1, got {st.batch_size}")
        need(st.epochs >= 1, f"{name}.epochs must be >= 1, got {st.epochs} (use --stages to skip a stage)")
        need(st.weight_decay >= 0, f"{name}.weight_decay must be >= 0, got {st.weight_decay}")
        need(0 <= st.warmup_ratio < 1, f"{name}.warmup_ratio must be in [0, 1), got {st.warmup_ratio}")
        need(st.max_grad_norm >= 0, f"{name}.max_grad_norm must be >= 0 (0 = off), got {st.max_grad_norm}")
    need(r.failure_ratio > 0, f"rctp.failure_ratio must be > 0, got {r.failure_ratio}")
    need(r.failure_attempts >= 0, f"rctp.failure_attempts must be >= 0, got {r.failure_attempts}")
    need(r.failure_temperature > 0, f"rctp.failure_temperature must be > 0, got {r.failure_temperature}")

    need(g.lr > 0, f"grpo.lr must be > 0, got {g.lr}")
    need(g.batch_size is None or g.batch_size >= 1, f"grpo.batch_size must be >= 1, got {g.batch_size}")
    need(g.group_size >= 2, f"grpo.group_size must be >= 2 (a group of 1 has no relative advantage), got {g.group_size}")
    need(g.steps >= 1, f"grpo.steps must be >= 1, got {g.steps}")
    need(g.beta >= 0, f"grpo.beta must be >= 0, got {g.beta}")
    need(0 <= g.eps_low < 1, f"grpo.eps_low must be in [0, 1), got {g.eps_low}")
    need(g.eps_high >= 0, f"grpo.eps_high must be >= 0, got {g.eps_high}")
    need(0 <= g.p_high <= 1, f"grpo.p_high must be in [0, 1], got {g.p_high}")
    need(g.temperature > 0, f"grpo.temperature must be > 0 (greedy rollouts give no group variance), got {g.temperature}")
    need(0 < g.top_p <= 1, f"grpo.top_p must be in (0, 1], got {g.top_p}")
    need(g.max_new_tokens >= 1, f"grpo.max_new_tokens must be >= 1, got {g.max_new_tokens}")
    need(g.max_total_tokens > d.max_prompt_tokens,
         f"grpo.max_total_tokens ({g.max_total_tokens}) must exceed data.max_prompt_tokens ({d.max_prompt_tokens})")
    need(g.loss_type in LOSS_TYPES, f"grpo.loss_type must be one of {LOSS_TYPES}, got {g.loss_type!r}")
    need(g.advantage_scale in ADVANTAGE_SCALES,
         f"grpo.advantage_scale must be one of {ADVANTAGE_SCALES}, got {g.advantage_scale!r}")
    need(g.updates_per_batch >= 1, f"grpo.updates_per_batch must be >= 1, got {g.updates_per_batch}")
    need(g.mini_batches >= 1, f"grpo.mini_batches must be >= 1, got {g.mini_batches}")
    need(g.batch_size is None or g.mini_batches <= g.batch_size,
         f"grpo.mini_batches ({g.mini_batches}) must not exceed grpo.batch_size ({g.batch_size}): "
         "a mini-batch holds whole groups")
    need(g.tis_cap is None or g.tis_cap > 0, f"grpo.tis_cap must be > 0 (none = off), got {g.tis_cap}")
    need(g.dynamic_sampling_max_draws >= 1,
         f"grpo.dynamic_sampling_max_draws must be >= 1, got {g.dynamic_sampling_max_draws}")
    need(not (run.pipeline in DYNAMIC_SAMPLING_PIPELINES and g.dynamic_sampling is False),
         f"grpo.dynamic_sampling false contradicts the pipeline {run.pipeline} (GRPO with dynamic sampling)")
    need(g.weight_decay >= 0, f"grpo.weight_decay must be >= 0, got {g.weight_decay}")
    need(g.max_grad_norm >= 0, f"grpo.max_grad_norm must be >= 0 (0 = off), got {g.max_grad_norm}")

    need(e.split in ("test", "train"), f"eval.split must be test or train, got {e.split!r}")
    need(e.subset is None or e.subset >= 1, f"eval.subset must be >= 1, got {e.subset}")
    need(e.conditioning in CONDITIONING, f"eval.conditioning must be one of {CONDITIONING}, got {e.conditioning!r}")
    need(e.max_new_tokens >= 1, f"eval.max_new_tokens must be >= 1, got {e.max_new_tokens}")

    if run.pipeline not in PIPELINES:
        problems.append(str(_unknown(run.pipeline, list(PIPELINES), "run.pipeline")))
    elif run.stages is not None:
        allowed = PIPELINES[run.pipeline]
        bad = [x for x in run.stages if x not in allowed]
        need(not bad, f"run.stages: {bad} not in pipeline {run.pipeline} (its stages: {list(allowed)})")
        need(bool(run.stages), "run.stages must not be empty (none = all stages)")
        need(len(set(run.stages)) == len(run.stages), f"run.stages has duplicates: {run.stages}")
    need(bool(run.name) and run.name not in (".", "..") and "/" not in run.name and os.sep not in run.name,
         f"run.name must be a plain folder name, got {run.name!r}")
    need(run.checkpoint_every >= 0, f"run.checkpoint_every must be >= 0, got {run.checkpoint_every}")
    need(run.keep_last >= 1, f"run.keep_last must be >= 1, got {run.keep_last}")
    need(run.micro_batch_tokens >= 1, f"run.micro_batch_tokens must be >= 1, got {run.micro_batch_tokens}")
    need(run.grad_accum >= 0, f"run.grad_accum must be >= 0 (0 = automatic), got {run.grad_accum}")
    need(run.device in DEVICES, f"run.device must be one of {DEVICES}, got {run.device!r}")
    need(run.engine in ENGINES, f"run.engine must be one of {ENGINES}, got {run.engine!r}")
    need(0 < run.engine_memory_fraction < 1,
         f"run.engine_memory_fraction must be in (0, 1), got {run.engine_memory_fraction}")
    _validate_world(cfg, need)
    need(cfg.data.doc_style in DOC_STYLES, f"data.doc_style must be one of {DOC_STYLES}, got {cfg.data.doc_style!r}")
    need(run.log_every >= 1, f"run.log_every must be >= 1, got {run.log_every}")
    unknown = [k for k in run.accept_changes or [] if k not in values]
    need(not unknown, f"run.accept_changes: {unknown} are not settings")

    if check_files:
        problems.extend(_missing_files(cfg))
    if problems:
        head = problems[0] if len(problems) == 1 else f"{len(problems)} problems:\n  - " + "\n  - ".join(problems)
        raise ConfigError(f"invalid configuration: {head}", problems)


def _validate_world(cfg: Config, need) -> None:
    """Settings that depend on the torchrun world (WORLD_SIZE, read from the
    environment so that a bad launch fails before any model loads)."""
    run = cfg.run
    world = os.environ.get("WORLD_SIZE", "1")
    world = int(world) if world.isdigit() else 1
    need(run.dist_timeout_s > 0, f"run.dist_timeout_s must be > 0, got {run.dist_timeout_s}")
    need(run.engine_tp_size >= 1, f"run.engine_tp_size must be >= 1, got {run.engine_tp_size}")
    if run.engine_tp_size > 1:
        need(run.engine == "vllm" and run.device == "cuda",
             f"run.engine_tp_size {run.engine_tp_size} needs run.engine vllm and run.device cuda "
             "(tensor-parallel engines are vLLM on GPUs)")
        need(world % run.engine_tp_size == 0,
             f"run.engine_tp_size {run.engine_tp_size} must divide the torchrun world size {world}")
    if world > 1:
        need(not cfg.model.lora.enabled,
             f"model.lora.enabled is single-process only; this torchrun job has {world} ranks")
        need(not cfg.grpo.dynamic_sampling,
             f"grpo.dynamic_sampling is single-process only; this torchrun job has {world} ranks")


def _missing_files(cfg: Config) -> list[str]:
    out = []
    src = cfg.model.name_or_path
    if src.startswith("embedded:"):
        if src != EMBEDDED_MODEL:
            out.append(f"model.name_or_path: unknown embedded model {src!r}; the only one is {EMBEDDED_MODEL!r}")
    else:
        local = Path(src).expanduser()
        # Same rule as rcgrpo.models: a hub id is exactly "owner/name".
        looks_local = src.startswith((".", "/", "~")) or src.count("/") != 1
        if local.exists():
            if not local.is_dir():
                out.append(f"model.name_or_path: {src} is not a folder")
            elif not (local / "config.json").is_file():
                out.append(f"model.name_or_path: {src} has no config.json (not a Hugging Face model folder)")
        elif looks_local:
            out.append(f"model.name_or_path: model folder {src} does not exist")
    if cfg.rctp.data_file is not None and not Path(cfg.rctp.data_file).expanduser().is_file():
        out.append(f"rctp.data_file: {cfg.rctp.data_file} does not exist")
    return out


# ------------------------------------------------------------------ writing


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are valid TOML basic strings
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _to_toml(d: dict) -> str:
    """Minimal TOML writer for this config's shapes (the stdlib only reads
    TOML). None has no TOML form: it is written as the string "none", which
    the reader maps back to None for the settings that accept none."""
    lines: list[str] = []

    def table(prefix: str, t: dict) -> None:
        scalars = {k: v for k, v in t.items() if not isinstance(v, dict)}
        subs = {k: v for k, v in t.items() if isinstance(v, dict)}
        if prefix:
            lines.append(f"\n[{prefix}]")
        for k, v in scalars.items():
            lines.append(f'{k} = "none"' if v is None else f"{k} = {_toml_value(v)}")
        for k, v in subs.items():
            table(f"{prefix}.{k}" if prefix else k, v)

    table("", d)
    return "\n".join(lines).lstrip("\n") + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(cfg.to_toml(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
