"""Which settings `python -m rcgrpo.eval --model` evaluates a model under:
explicit flags, else its run's config.toml (for a run's models/<stage>
folder), else the built-in defaults; and whether the model is asked for a
reward token (rcgrpo.conditioning.reward_tokens decides from the stage it comes from)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rcgrpo.base.errors import UserError
from rcgrpo.conditioning.reward_tokens import stage_saw_reward_tokens
from rcgrpo.config import Config, ConfigError, load_config
from rcgrpo.run.folder import RunFolder

SETTINGS = ("max_new_tokens", "max_total_tokens", "doc_style", "conditioning")


def _settings_of(cfg: Config) -> dict:
    """The generation and prompt settings of `cfg` (all of SETTINGS but the
    conditioning, which depends on the stage)."""
    return {"max_new_tokens": cfg.eval.max_new_tokens, "max_total_tokens": cfg.grpo.max_total_tokens,
            "doc_style": cfg.data.doc_style}


# A model outside a run is evaluated under the schema's defaults (one home:
# rcgrpo/config/schema.py), not a preset's.
DEFAULTS = _settings_of(Config())


class EvalSettingsError(UserError, ValueError):
    """The settings of --model cannot be worked out (e.g. a broken run config)."""


@dataclass
class EvalSettings:
    """The generation and prompt settings one --model evaluation runs under."""

    max_new_tokens: int
    max_total_tokens: int
    doc_style: str
    conditioning: str
    source: str  # "runs/x/config.toml" or "built-in defaults"
    stage: str | None = None  # the run's stage, for a models/<stage> folder
    why_conditioning: str = ""  # why this conditioning, when not from a flag
    from_flags: list[str] = field(default_factory=list)  # settings the user gave

    def describe(self) -> str:
        """One line: the values and where they came from."""
        parts = []
        for name in SETTINGS:
            text = f"{name} {getattr(self, name)}"
            if name in self.from_flags:
                text += " (flag)"
            elif name == "conditioning" and self.why_conditioning:
                text += f" ({self.why_conditioning})"
            parts.append(text)
        return f"settings from {self.source}: " + ", ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


def run_stage_of(model: str) -> tuple[Path, str] | None:
    """(the run's config.toml, the stage) when `model` is a run's
    models/<stage> folder, else None."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    path = path.resolve()
    config = RunFolder(path.parent.parent).config_toml
    if path.parent.name != RunFolder.MODELS or not config.is_file():
        return None
    return config, path.name


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path.as_posix() if rel.startswith("..") else Path(rel).as_posix()


def _load_run_config(config_path: Path) -> Config:
    """The run's Config; a broken file is one EvalSettingsError line naming it."""
    shown = _shown(config_path)
    try:
        return load_config(shown, check_files=False)
    except ConfigError as exc:
        message = "; ".join(" ".join(p.split()) for p in exc.problems)
    except (OSError, UnicodeDecodeError) as exc:
        message = f"cannot be read: {exc}"
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # e.g. a value where a [section] belongs
        message = f"cannot be used: {type(exc).__name__}: {exc}"
    if shown not in message:
        message = f"run config {shown}: {message}"
    raise EvalSettingsError(f"{message} (fix the file, or copy the model folder out of the run)")


def _has_own_reward_tokens(model: str) -> tuple[bool, str]:
    """Whether `model` outside a run already knows the reward tokens, and why."""
    from rcgrpo.model.loading import EMBEDDED, _has_reward_tokens

    if str(model) == EMBEDDED:
        return False, "the embedded model has no reward tokens"
    from rcgrpo.model import hub

    local = Path(model).expanduser()
    if not local.exists() and hub.is_hub_id(str(model)):
        # Only what is in the Hugging Face cache is read (eval fetches a hub id first).
        local = hub.cached(str(model))
        if local is None:
            return False, f"{model} is not fetched, so taken to have no reward tokens"
    if not local.exists():
        return False, f"{model} has no reward tokens"  # a bad path fails when it loads
    try:
        has = _has_reward_tokens(local)
    except Exception:  # not a loadable tokenizer: the model load names the problem
        has = False
    return has, f"{model} {'has' if has else 'has no'} reward tokens"


def resolve_eval_settings(model: str, args) -> EvalSettings:
    """The settings to evaluate `model` under: explicit flags (non-None
    attributes of `args`), then its run's config.toml when `model` is a run's
    models/<stage> folder, then the built-in defaults. Loads no engine and no
    weights (at most a tokenizer). Raises EvalSettingsError for a broken run
    config or a stage folder whose training the stage name does not tell."""
    given = {name: getattr(args, name, None) for name in SETTINGS}
    from_flags = [name for name in SETTINGS if given[name] is not None]
    run = run_stage_of(model)
    if run is not None:
        config_path, stage = run
        cfg = _load_run_config(config_path)
        base = _settings_of(cfg)
        source, why = _shown(config_path), f"stage {stage}"
        if given["conditioning"] is None:
            try:
                saw = stage_saw_reward_tokens(stage, cfg.finetune_stage)
            except ValueError as exc:
                raise EvalSettingsError(f"{model}: {exc}, so whether it was trained with reward tokens "
                                        "is unknown; pass --conditioning") from exc
            base["conditioning"] = cfg.eval.conditioning if saw else "none"
            if not saw:
                why = f"stage {stage} of {cfg.run.pipeline} never saw reward tokens"
        run_stage = stage
    else:
        base, source, run_stage = dict(DEFAULTS), "built-in defaults", None
        why = ""
        if given["conditioning"] is None:
            has, why = _has_own_reward_tokens(model)
            base["conditioning"] = "high" if has else "none"
    values = {name: given[name] if given[name] is not None else base[name] for name in SETTINGS}
    return EvalSettings(**values, source=source, stage=run_stage, why_conditioning=why, from_flags=from_flags)
