"""The settings' schema: every section of the configuration as a dataclass,
each field with its default, its help text and its limits (choices, bounds),
so that each limit is stated once, next to the setting it bounds; the lists
of choices; ``Config``, the whole; ``ConfigError``; and the walks over the
dotted keys (``leaves``, ``all_keys``, ``flat_values``, ``resume_safe_keys``).

Defaults are the numbers of the paper (arXiv 2602.03025) where it gives them
(marked "paper"); everything else is this project's choice and says so.
Nothing here reads or checks a value: rcgrpo/config/io.py sets and writes
them, rcgrpo/config/validation.py checks the limits declared here.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import rcgrpo_kernels
from rcgrpo.base.errors import UserError
from rcgrpo.base.stages import FINETUNE_STAGES, PIPELINES, RL_STAGES
from rcgrpo.conditioning.prompts import DOC_STYLES
from rcgrpo.conditioning.reward_tokens import CONDITIONING_NAMES, HIGH_REWARD
from rcgrpo.envs.data import CATEGORIES
from rcgrpo.envs.shipped import SHIPPED_ENVIRONMENTS
from rcgrpo.envs.tool_calls import TOOL_FORMATS
from rcgrpo.envs.tool_env import DEFAULT_CALL_TIMEOUT_S, DEFAULT_MAX_TOOL_STEPS
from rcgrpo.model.shape import LAYER_PROJECTIONS
from rcgrpo.rollout import ENGINES
from rcgrpo.run.trackers import TRACKERS

# Kept in sync with rcgrpo.model.loading.EMBEDDED by a test; not imported, so that
# validating a config does not load transformers.
EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
# The loss types' one list lives with their definitions (rcgrpo_kernels/loss_types.py).
LOSS_TYPES = tuple(rcgrpo_kernels.LOSS_TYPES)
# The estimators' lists live with their definitions (rcgrpo_kernels/*_estimators.py).
ADVANTAGE_ESTIMATORS = tuple(rcgrpo_kernels.ADVANTAGE_ESTIMATORS)
KL_ESTIMATORS = tuple(rcgrpo_kernels.KL_ESTIMATORS)
DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")
DEVICES = ("auto", "cpu", "cuda")
CONDITIONING = ("auto", *CONDITIONING_NAMES)
SEED_MAX = 2**32 - 1  # numpy.random.seed's upper bound

# Where the RCTP set's failures come from (`rctp.failure_source`); what each
# one is: rcgrpo/data/rctp.py.
# * rollouts: reward-0 rollouts of the starting model (the paper's source:
#   base-model exploration rollouts);
# * near_miss: the expert trajectory with one call dropped or one argument
#   changed, kept when executing it gives reward 0;
# * late_divergence: reward-0 rollouts whose first divergence from the expert
#   comes at least `rctp.min_divergence_tokens` generated tokens into the reply.
FAILURE_SOURCES = ("rollouts", "near_miss", "late_divergence")
EXPERT_SOURCES = ("reference", "rollouts")


class ConfigError(UserError, ValueError):
    """A setting is unknown, mistyped, impossible, or names a missing file.

    ``problems`` lists every message when validation found several.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = list(problems) or [message]


def _f(default: Any, help: str, resume_safe: bool = False, *, choices: Sequence = (), ge=None, gt=None,
       le=None, lt=None, nonempty: bool = False, unique: bool = False, note: str = ""):
    """A dataclass field with its help text and its limits (lists get a fresh
    copy each time).

    ``resume_safe``: changing the setting between a run and its ``--resume``
    changes neither what was trained nor what will be (how often to save,
    what to evaluate, where to run); every other change is refused there.
    The limits (checked in rcgrpo/config/validation.py): ``choices`` (of each
    item, for a list), the bounds ``ge`` >=, ``gt`` >, ``le`` <=, ``lt`` <,
    and for a list ``nonempty`` and ``unique``; ``note`` is said after a broken
    limit. None, where a setting accepts it, passes every limit; a float must
    also be finite.
    """
    meta = {"help": help, "resume_safe": resume_safe, "choices": tuple(choices), "ge": ge, "gt": gt,
            "le": le, "lt": lt, "nonempty": nonempty, "unique": unique, "note": note}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class LoraConfig:
    """LoRA adapters (rcgrpo/model/lora.py; needs `peft`, the `lora` extra). The
    engine and the exported stage models get the merged weights."""

    enabled: bool = _f(False, "train LoRA adapters instead of all weights (needs `pip install peft==0.21.2`)")
    r: int = _f(16, "LoRA rank", ge=1)
    alpha: float = _f(32.0, "LoRA alpha (scale = alpha / r)", gt=0)
    dropout: float = _f(0.05, "LoRA dropout, in [0, 1)", ge=0, lt=1)
    target_modules: list[str] = _f(
        list(LAYER_PROJECTIONS), "modules that get adapters",
        nonempty=True,
    )


@dataclass
class ModelConfig:
    """The policy every stage starts from, and how it computes."""

    name_or_path: str = _f(EMBEDDED_MODEL, f"local HF folder, hub id (owner/name), or {EMBEDDED_MODEL}")
    dtype: str = _f(
        "float32",
        f"compute dtype of the matmuls, one of {DTYPES}: bf16/fp16 run under autocast (FSDP2: a mixed-precision "
        "policy); master weights, gradients and AdamW state stay float32 (CPU: float32 is fastest)",
        choices=DTYPES,
    )
    export_dtype: str = _f(
        "float32",
        f"dtype of each stage's exported model (the next stage's start), one of {DTYPES}; float32 keeps every "
        "update, bfloat16 halves the size and rounds away updates below ~0.4% of a weight",
        choices=DTYPES,
    )
    attn_implementation: str = _f(
        "auto", f"one of {ATTN_IMPLEMENTATIONS}; auto = flash_attention_2 on CUDA when installed, else sdpa",
        resume_safe=True, choices=ATTN_IMPLEMENTATIONS,
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory", resume_safe=True)
    share_prefixes: bool = _f(
        True, "forward the prompt prefix a micro-batch's sequences share once, attended as a tree (sdpa, "
        "flash-attn varlen; eager with a mask): same hidden states and gradients, a group's prompt computed once; "
        "checked against the dense forward by each stage (parity_check_every)",
        resume_safe=True,
    )
    parity_check_every: int = _f(
        0, "with share_prefixes: the shared-prefix forward's log-probs are checked against every sequence forwarded "
        "whole on the first micro-batch of each stage that shares a prefix (tree_parity_max_abs in metrics.jsonl; "
        "the run stops above a bound per model.dtype), and again every this many steps (two extra no-gradient "
        "forwards of one micro-batch each time); 0 = once per stage", resume_safe=True, ge=0)
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA settings"})


BFCL = "bfcl"


@dataclass
class EnvConfig:
    """The environment a run trains and evaluates on: BFCL (the paper's), an
    environment rcgrpo ships, or the user's, in TRL's contract
    (rcgrpo.envs.tool_env; the Python trainer hands objects in directly)."""

    name: str = _f(
        BFCL, f"{BFCL} (BFCL v4 multi-turn), a shipped environment ({', '.join(SHIPPED_ENVIRONMENTS)}), or "
        "module:attr naming an environment_factory in TRL's contract (a class whose instances have reset(**row) "
        "and tools as public methods, optionally get_reward()); python:NAME records objects the Python trainer "
        "was given")
    dataset: Optional[str] = _f(
        None, "training tasks: a .jsonl file of rows with a prompt column (text or messages) and any columns; none "
        "= the environment's own (BFCL's training split, a shipped environment's train split)")
    eval_dataset: Optional[str] = _f(None, "evaluation tasks, as dataset (none = the environment's own test split)",
                                     resume_safe=True)
    tools: Optional[list[str]] = _f(None, "standalone tools (module:function, typed, Google-style docstrings), "
                                    "besides the environment's methods", nonempty=True, unique=True)
    reward_funcs: Optional[list[str]] = _f(
        None, "reward functions (module:function): f(prompts, completions, **columns) -> list of floats or None, "
        "summed with get_reward()", nonempty=True, unique=True)
    success_threshold: float = _f(1.0, "a rollout succeeds (RCTP's high label, eval accuracy) iff its reward is at "
                                  "least this")
    reward_range: Optional[list[float]] = _f(
        None, "[low, high]: a reward outside it is a scored failure (reward low); none = any finite number",
        nonempty=True)
    tool_format: str = _f("auto", f"how tool calls are written, one of {TOOL_FORMATS}: template = the chat "
                          "template's tools (Qwen2.5, Llama-3.1), json_tags = schemas in the system prompt and "
                          "<tool_call>{json}</tool_call> replies; auto = template when it renders tools",
                          choices=TOOL_FORMATS)
    max_tool_steps: int = _f(DEFAULT_MAX_TOOL_STEPS, "replies with tool calls per episode, at most", ge=1)
    call_timeout_s: float = _f(DEFAULT_CALL_TIMEOUT_S, "seconds one call of user code (tool, reset, reward) may "
                               "take", gt=0)


@dataclass
class DataConfig:
    """Which training tasks, and how BFCL's prompts are written (categories,
    entry_ids and doc_style are BFCL's; the rest applies to every environment)."""

    categories: list[str] = _f(list(CATEGORIES), f"BFCL multi-turn categories, subset of {CATEGORIES}",
                               choices=CATEGORIES, nonempty=True, unique=True)
    max_prompt_tokens: int = _f(6144, "skip entries whose first prompt is longer (choice: fits an 8k context)", ge=1)
    train_subset: Optional[int] = _f(
        None, "use only this many training entries, a seeded choice (none = all 720; ignored with entry_ids)", ge=1)
    entry_ids: Optional[list[str]] = _f(
        None, "train only on these training-split entry ids, e.g. multi_turn_base_100 (none = all; then "
        "train_subset); an explicit list wins over train_subset", nonempty=True, unique=True,
    )
    seed: int = _f(0, "seed for data order, subsets, reward-token draws and torch", ge=0, le=SEED_MAX,
                   note="numpy's seed range")
    doc_style: str = _f("compact", f"function docs in the system prompt, one of {DOC_STYLES} (choice: compact JSON)",
                        choices=DOC_STYLES)


@dataclass
class SftConfig:
    """Supervised fine-tuning on expert trajectories (the SFT baseline)."""

    lr: float = _f(1e-5, "learning rate (paper)", gt=0)
    batch_size: int = _f(16, "trajectories per optimizer step (paper)", ge=1)
    epochs: int = _f(2, "epochs over the expert trajectories (paper)", ge=1, note="use --stages to skip a stage")
    weight_decay: float = _f(0.0, "AdamW weight decay (choice)", ge=0)
    warmup_ratio: float = _f(0.0, "fraction of steps with linear warm-up (choice)", ge=0, lt=1)
    max_grad_norm: float = _f(1.0, "gradient clipping norm; 0 = off (choice)", ge=0, note="0 = off")


@dataclass
class RctpConfig(SftConfig):
    """The same fine-tuning on the reward-tagged expert + failure set, plus how
    that set is built (the redeclared `epochs` keeps its place in the order)."""

    epochs: int = _f(5, "epochs over the RCTP set (paper)", ge=1, note="use --stages to skip a stage")
    failure_ratio: float = _f(1.0, "failure : expert trajectories (paper: 1:1)", gt=0)
    failure_source: str = _f(
        "rollouts", f"where failures come from, one of {FAILURE_SOURCES}: reward-0 rollouts of the starting "
        "model (paper), the expert with one call dropped or one argument changed (near_miss), or rollouts whose "
        "first divergence from the expert comes at least min_divergence_tokens into the reply; each labelled by "
        "executing it", choices=FAILURE_SOURCES)
    failure_attempts: int = _f(4, "rollouts of the starting model per training entry to find failures (choice)",
                               ge=0)
    failure_temperature: float = _f(1.0, "sampling temperature of those rollouts (choice)", gt=0)
    min_divergence_tokens: int = _f(
        8, "late_divergence: generated tokens a rollout must share with the expert before it parts (choice)", ge=1)
    fill_with_perturbed: bool = _f(True, "top up a rollout source short of failures with near misses")
    expert_source: str = _f(
        "reference", f"where experts come from, one of {EXPERT_SOURCES}: the ground truth / the data set's completion "
        "column (reference), or the starting model's rollouts that succeed (reward >= env.success_threshold; the "
        "paper's way), failures then being its rollouts that do not; 1:1 either way", choices=EXPERT_SOURCES)
    expert_model: Optional[str] = _f(
        None, "expert_source rollouts: a stronger model (folder or hub id) whose successful rollouts are the experts, "
        "played with the transformers engine and replayed as text under the policy's template; none = the starting "
        "model's own")
    steer_every: int = _f(
        1, "RCTP steps between measurements of the steer (how much more likely the expert's token is under the "
        "high tag than the low at each pair's first divergent token; also at step 0); 0 = off", resume_safe=True,
        ge=0)
    steer_pairs: int = _f(16, "expert/failure pairs the steer is measured on, at most (a seeded choice)",
                          resume_safe=True, ge=1)
    data_file: Optional[str] = _f(None, "reuse this RCTP JSONL instead of building it (must exist)")


@dataclass
class GrpoConfig:
    """GRPO and RC-GRPO share these; the pipeline decides whether rollouts are
    reward-conditioned."""

    lr: float = _f(1e-6, "learning rate (paper)", gt=0)
    batch_size: Optional[int] = _f(
        None, "prompts per step; none = the paper's batch: 256 for rc-grpo, 64 for grpo", ge=1, le=16384,
        note="the paper uses 256"
    )
    # The upper bounds leave the paper's values (G 5, batch 256) far inside;
    # the memory plan judges what fits below them (rollouts held per step).
    group_size: int = _f(5, "rollouts per prompt, G (paper)", ge=2, le=1024,
                         note="a group of 1 has no relative advantage, the paper uses 5")
    steps: int = _f(400, "optimizer steps (the paper's 'epochs' column: 400)", ge=1)
    beta: float = _f(0.1, "KL coefficient to the frozen reference (paper)", ge=0)
    eps_low: float = _f(0.2, "clip range below 1 (paper)", ge=0, lt=1)
    eps_high: float = _f(0.2, "clip range above 1 (paper)", ge=0)
    p_high: float = _f(0.5, f"RC-GRPO: P({HIGH_REWARD}) per rollout (paper)", ge=0, le=1)
    temperature: float = _f(1.0, "rollout sampling temperature (choice)", gt=0,
                            note="greedy rollouts give no group variance")
    top_p: float = _f(1.0, "rollout nucleus sampling (choice)", gt=0, le=1)
    max_new_tokens: int = _f(512, "max tokens per assistant step (choice)", ge=1)
    max_total_tokens: int = _f(8192, "max tokens of a whole trajectory (choice: the small model's context)", ge=1)
    loss_type: str = _f("grpo", f"loss normalisation, one of {LOSS_TYPES} (rcgrpo_kernels/loss_types.py maps them to "
                        "verl's loss_agg_mode and TRL's loss_type)", choices=LOSS_TYPES)
    advantage_estimator: str = _f(
        "grpo", f"group advantage estimator, one of {ADVANTAGE_ESTIMATORS}: grpo = (R - mean) / (std + eps) with "
        "the population std (paper), grpo_ddof1 = sample std (verl, TRL), dr_grpo = R - mean, rloo = leave-one-out",
        choices=ADVANTAGE_ESTIMATORS)
    kl_estimator: str = _f("k3", f"KL estimator, one of {KL_ESTIMATORS} (rcgrpo_kernels/kl_estimators.py): k3 = paper, "
                           "verl low_var_kl, TRL; '+' = straight-through with k2's gradient", choices=KL_ESTIMATORS)
    clip_ratio_c: Optional[float] = _f(
        None, "dual-clip PPO: a negative-advantage token's ratio counts at most this much (verl's default 3.0); "
        "none = off (paper)", gt=1, note="none = off")
    log_ratio_clamp: Optional[float] = _f(
        None, "clamp logp - old and logp - ref to [-c, c] before exp (verl: 20); none = off (paper, TRL)", gt=0,
        note="none = off")
    kl_clamp: Optional[float] = _f(None, "clamp the KL value to [-c, c] (verl: 10 for k3); none = off", gt=0,
                                   note="none = off")
    updates_per_batch: int = _f(
        1, "PPO epochs (mu): passes over each rollout batch; > 1 computes the trainer's old log-probs once "
        "before the first update, and the clip then acts (choice: 1, on-policy)", ge=1)
    mini_batches: int = _f(
        1, "optimizer steps per pass: the batch's groups are split into this many mini-batches (choice: 1)", ge=1)
    tis_cap: Optional[float] = _f(
        None, "truncated importance sampling (Yao et al. 2025): each token's loss weighted by "
        "min(exp(logp_old_trainer - logp_engine), cap), no gradient through it; none = off", gt=0, note="none = off")
    loss_over_informative_groups: bool = _f(
        False, "the loss (and its normaliser) covers only groups with non-zero advantage; zero-variance groups, "
        "KL term included, are left out")
    dynamic_sampling: Optional[bool] = _f(
        None, "DAPO dynamic sampling: drop zero-variance groups and draw more prompts in the same step until "
        "batch_size informative groups (or max_draws); none = on for the sft+grpo-ds pipeline only")
    dynamic_sampling_max_draws: int = _f(
        4, "dynamic sampling: rollout rounds per step at most, the scheduled prompts' round included", ge=1)
    weight_decay: float = _f(0.0, "AdamW weight decay (choice)", ge=0)
    max_grad_norm: float = _f(1.0, "gradient clipping norm; 0 = off (choice)", ge=0, note="0 = off")
    eval_every: int = _f(
        10, "steps between measurements of the sampled reward on a fixed sample of training prompts (also "
        "before the first step and after the last; under each reward token when the policy knows them); 0 = off",
        resume_safe=True, ge=0)
    eval_rollouts: int = _f(64, "rollouts per measurement and reward token, over at most as many training entries",
                            resume_safe=True, ge=1, le=16384)


@dataclass
class EvalConfig:
    """The evaluation that ends a run (rcgrpo-eval takes the same keys)."""

    split: str = _f("test", "test (80 entries) or train", resume_safe=True, choices=("test", "train"))
    subset: Optional[int] = _f(None, "evaluate only this many entries (none = the whole split)", resume_safe=True,
                               ge=1)
    categories: list[str] = _f(list(CATEGORIES), "categories to evaluate", resume_safe=True,
                               choices=CATEGORIES, nonempty=True, unique=True)
    greedy: bool = _f(True, "greedy decoding (else sample at grpo.temperature)", resume_safe=True)
    conditioning: str = _f(
        "auto", f"reward token in the prompt, one of {CONDITIONING}; auto = high for reward-conditioned pipelines",
        resume_safe=True, choices=CONDITIONING,
    )
    max_new_tokens: int = _f(512, "max tokens per assistant step", resume_safe=True, ge=1)


@dataclass
class RunConfig:
    """Where the run lives, what runs it, what it logs."""

    name: Optional[str] = _f(None, "run name: the run lives in out_dir/name (none = the pipeline's name)")
    out_dir: str = _f("runs", "parent folder of runs")
    pipeline: str = _f("rctp+rc-grpo", f"one of {tuple(PIPELINES)}", choices=tuple(PIPELINES))
    stages: Optional[list[str]] = _f(None, "run only these stages of the pipeline (none = all)", resume_safe=True,
                                     nonempty=True, unique=True, note="none = all stages")
    fused: bool = _f(False, "fused linear+loss kernels (Triton on CUDA, chunked on CPU)", resume_safe=True)
    resume: bool = _f(False, "continue the run from its latest good checkpoint", resume_safe=True)
    checkpoint_every: int = _f(
        50, "optimizer steps between checkpoints; 0 = only at the end of a stage", resume_safe=True, ge=0
    )
    keep_last: int = _f(3, "checkpoints kept per stage", resume_safe=True, ge=1)
    micro_batch_tokens: int = _f(8192, "tokens per packed micro-batch", resume_safe=True, ge=1)
    device: str = _f("auto", f"one of {DEVICES}", resume_safe=True, choices=DEVICES)
    engine: str = _f("auto", f"rollout engine, one of {ENGINES} (auto: vLLM when installed)", resume_safe=True,
                     choices=ENGINES)
    engine_tp_size: int = _f(
        1, "torchrun: ranks per tensor-parallel vLLM engine (1 = an engine per rank); divides the world size",
        resume_safe=True, ge=1,
    )
    engine_memory_fraction: float = _f(
        0.5, "CUDA: share of the GPU's memory the vLLM engine takes while awake (it sleeps during updates)",
        resume_safe=True, gt=0, lt=1,
    )
    dist_timeout_s: float = _f(
        1800.0, "torchrun: seconds a collective waits for a peer before failing (bounds a hang on a dead rank)",
        resume_safe=True, gt=0,
    )
    report_to: Optional[list[str]] = _f(
        ["tensorboard"], f"trackers that get the metrics besides metrics.jsonl, of {tuple(TRACKERS)}: tensorboard "
        "writes run_dir/tb/<stage>, wandb and mlflow a run per stage (their usual environment variables apply; "
        "each needs its package); none = metrics.jsonl only (was run.tensorboard)",
        resume_safe=True, choices=tuple(TRACKERS), nonempty=True, unique=True, note="none = metrics.jsonl only")
    push_to_hub: Optional[str] = _f(
        None, "upload each trained stage's export (model + tokenizer; LoRA: adapter/ too) to this Hub repo, "
        "owner/name, one commit per stage (token: HF_TOKEN or `hf auth login`, checked before training); "
        "none = off", resume_safe=True)
    accept_changes: Optional[list[str]] = _f(
        None, "--resume: settings whose change from the saved run is accepted anyway (recorded in the run's "
        "config_changes.jsonl); e.g. grpo.lr,grpo.steps", resume_safe=True,
    )


@dataclass
class Config:
    """Every setting: one section per stage or concern, and the preset that
    was applied first."""

    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rctp: RctpConfig = field(default_factory=RctpConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preset: Optional[str] = _f(None, "named preset applied first")

    # ---- derived views, so callers need not re-derive pipeline facts
    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / str(self.run.name or slug(self.run.pipeline))

    @property
    def stages(self) -> list[str]:
        """The stages to run, in pipeline order."""
        all_stages = PIPELINES[self.run.pipeline]
        wanted = self.run.stages or list(all_stages)
        return [s for s in all_stages if s in wanted]

    @property
    def finetune_stage(self) -> str:
        return next(s for s in PIPELINES[self.run.pipeline] if s in FINETUNE_STAGES)

    @property
    def rl_stage(self) -> str:
        return next(s for s in PIPELINES[self.run.pipeline] if s in RL_STAGES)

    def to_dict(self) -> dict:
        """Nested sections as plain dicts (what config.json holds); writing
        and reading files is rcgrpo/config/io.py's."""
        return dataclasses.asdict(self)


def slug(text: str) -> str:
    """`text` as a folder name: every character but letters, digits and -_. becomes _."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


# ------------------------------------------------------------ dotted keys


def leaves(obj, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any, Any]]:
    """(dotted key, field, type, value) of every setting, in declaration order."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, prefix + f.name + ".")
        else:
            yield prefix + f.name, f, hints[f.name], value


def all_keys(cfg: Optional[Config] = None) -> dict[str, tuple[Any, str]]:
    """Every dotted key -> (type, help), in declaration order."""
    return {key: (tp, f.metadata.get("help", "")) for key, f, tp, _ in leaves(cfg or Config())}


def flat_values(cfg: Config) -> dict[str, Any]:
    """Every dotted key -> its value in `cfg`."""
    return {key: value for key, _, _, value in leaves(cfg)}


def resume_safe_keys() -> frozenset[str]:
    """The dotted keys whose fields say `resume_safe` (see `_f`); and the
    preset name, whose effect shows in the values it set."""
    return frozenset({key for key, f, _, _ in leaves(Config()) if f.metadata.get("resume_safe")} | {"preset"})

