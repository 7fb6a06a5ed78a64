"""The configuration: every setting of the pipeline, its default and limits,
the presets, and the ways a Config is made, read, written and checked. This
is the door: the rest of rcgrpo imports from ``rcgrpo.config``; the modules
behind it each do one job and import one another only downward, in this
order::

    schema      the sections as dataclasses, each field with its help and
                limits; Config, ConfigError, the choice lists, dotted keys
    presets     the named presets (data in presets.toml)
    validation  the limits and the rules relating settings; finalize
    io          settings by dotted key, TOML in and out, a Config saved
                into its run folder or made from a saved dict
    cli         the command line of rcgrpo-train and python -m rcgrpo.config

Layers, later wins::

    dataclass defaults  <-  --preset NAME  <-  --config FILE.toml  <-  CLI flags

Everything is validated before any model or data loads: an unknown key (with
the closest known key suggested), a wrong type, an impossible value or a
missing file raises ``ConfigError`` naming the setting.

May import: rcgrpo.base, envs, conditioning, run, model, rollout and
rcgrpo_kernels (the layers below it; tests/test_layout.py checks).

``python -m rcgrpo.config [flags]`` prints the resolved configuration as TOML.
"""

from rcgrpo.base.stages import DYNAMIC_SAMPLING_PIPELINES, FINETUNE_STAGES, PAPER_RL_BATCH, PIPELINES, RL_STAGES
from rcgrpo.config.cli import load_config, parse_args
from rcgrpo.config.io import config_from_dict, config_to_toml, save_config
from rcgrpo.config.presets import DEFAULT_PRESET, PRESETS
from rcgrpo.config.schema import (
    ADVANTAGE_ESTIMATORS,
    ATTN_IMPLEMENTATIONS,
    CONDITIONING,
    DEVICES,
    DTYPES,
    EMBEDDED_MODEL,
    FAILURE_SOURCES,
    KL_ESTIMATORS,
    LOSS_TYPES,
    SEED_MAX,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    GrpoConfig,
    LoraConfig,
    ModelConfig,
    RctpConfig,
    RunConfig,
    SftConfig,
    all_keys,
    flat_values,
    leaves,
    resume_safe_keys,
)
from rcgrpo.config.validation import finalize

__all__ = [
    # the schema
    "ConfigError", "Config", "ModelConfig", "LoraConfig", "DataConfig", "RctpConfig", "SftConfig",
    "GrpoConfig", "EvalConfig", "RunConfig",
    "EMBEDDED_MODEL", "LOSS_TYPES", "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "DTYPES", "ATTN_IMPLEMENTATIONS",
    "DEVICES", "CONDITIONING", "SEED_MAX", "FAILURE_SOURCES",
    "leaves", "all_keys", "flat_values", "resume_safe_keys",
    # the pipelines' stages the schema's settings name (rcgrpo/base/stages.py)
    "PIPELINES", "FINETUNE_STAGES", "RL_STAGES", "PAPER_RL_BATCH", "DYNAMIC_SAMPLING_PIPELINES",
    # presets
    "PRESETS", "DEFAULT_PRESET",
    # making, reading and writing a Config
    "parse_args", "load_config", "finalize", "config_from_dict", "config_to_toml", "save_config",
]
