"""A LoRA stage's adapter that another machine loads onto the user's model.

peft records as an adapter's base the folder the policy was loaded from: a
conversion in rcgrpo's cache, or the previous stage's export; neither exists
anywhere else. `make_shareable` rewrites a stage's exported `adapter/` into an
adapter of the user's `model.name_or_path` itself (a hub id, or the path as
given), loadable with transformers and peft alone (README, "Sharing"):

* `adapter_config.json` names that id as `base_model_name_or_path`;
* the tokenizer (the base's, plus the reward tokens with the same ids) is
  saved beside the adapter, and `rcgrpo_base.json` records the id, the tokens
  rcgrpo added with their ids, and the stages the adapter holds;
* the reward tokens' rows travel in the adapter (peft's trainable tokens; an
  untied LM head's rows too: rcgrpo.model.lora.wrap), so whatever values a resize
  gives those rows on the other machine never matter;
* a stage that started from an earlier LoRA stage's export trained an adapter
  of *that* model (the base plus the earlier adapter, merged). It is composed
  with the earlier stage's adapter (itself already composed) into one of rank
  r1 + r2: A = [A1; A2], B = [s1 B1, s2 B2] at scale 1, which adds exactly
  s1 B1 A1 + s2 B2 A2; its token rows are the later stage's. Exact up to
  float rounding when the exports are float32 (`model.export_dtype`); a
  bfloat16 export rounds the later stage's starting weights, which the
  composed adapter does not.

A stage that started from a model that is no adapter of the user's (e.g. a
full fine-tune before it), or whose adapter cannot be composed with the
earlier one (model.lora changed between the stages), keeps peft's own record,
and the run says so.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from rcgrpo.model.lora import ADAPTER_CONFIG, ADAPTER_DIR

__all__ = ["BASE_RECORD", "ADAPTER_WEIGHTS", "make_shareable", "read_base_record"]

BASE_RECORD = "rcgrpo_base.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_base_record(adapter_dir: Path) -> dict | None:
    from rcgrpo.base import json_input

    path = Path(adapter_dir) / BASE_RECORD
    return json_input.read_file(path, expect=dict) if path.is_file() else None


def make_shareable(adapter_dir: Path, *, stage: str, model_id: str, added_tokens: dict[str, int], tokenizer,
                   start: Path, base: Path) -> str | None:
    """Rewrite the peft adapter `adapter_dir` (saved by the stage that started
    from `start`) as an adapter of `model_id`, whose token-extended folder is
    `base` (see the module docstring). Returns None, or why it is left an
    adapter of `start` as peft wrote it (true, if not portable)."""
    adapter_dir = Path(adapter_dir)
    first = Path(start).resolve() == Path(base).resolve()
    previous = None if first else read_base_record(Path(start) / ADAPTER_DIR)
    if not first and previous is None:
        return f"the stage started from {start}, which holds no adapter of {model_id}"
    stages = [stage]
    if previous is not None:
        try:
            _compose(Path(start) / ADAPTER_DIR, adapter_dir)
        except ValueError as e:
            return str(e)
        stages = previous["stages"] + stages
        added_tokens = previous["added_tokens"]
    config_path = adapter_dir / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = model_id
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(adapter_dir)
    record = {"base_model": model_id, "added_tokens": added_tokens, "stages": stages}
    (adapter_dir / BASE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return None


def _scale(config: dict) -> float:
    if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        # rcgrpo.model.lora.wrap makes none of these; a hand-made adapter is not composed.
        raise ValueError("LoRA composition: rslora / rank_pattern / alpha_pattern are not supported")
    return config["lora_alpha"] / config["r"]


def _compose(earlier_dir: Path, later_dir: Path) -> None:
    """`later_dir`'s adapter becomes earlier + later, in place (see the
    module docstring); both were saved by `PeftModel.save_pretrained`."""
    from safetensors.torch import load_file, save_file

    earlier_cfg = json.loads((earlier_dir / ADAPTER_CONFIG).read_text())
    later_cfg = json.loads((later_dir / ADAPTER_CONFIG).read_text())
    earlier = load_file(str(earlier_dir / ADAPTER_WEIGHTS))
    later = load_file(str(later_dir / ADAPTER_WEIGHTS))
    if earlier.keys() != later.keys():
        odd = sorted(earlier.keys() ^ later.keys())
        raise ValueError(f"LoRA composition: the stages adapt different tensors (model.lora changed?), e.g. {odd[0]}")
    s_earlier, s_later = _scale(earlier_cfg), _scale(later_cfg)
    out = {}
    for key, t in later.items():
        if ".lora_A." in key:  # [r, in]: the ranks stacked
            out[key] = torch.cat([earlier[key].float(), t.float()], dim=0)
        elif ".lora_B." in key:  # [out, r]: each stage's scale folded in
            out[key] = torch.cat([earlier[key].float() * s_earlier, t.float() * s_later], dim=1)
        else:  # the reward-token rows: the later stage's values replace the earlier ones
            out[key] = t
    rank = earlier_cfg["r"] + later_cfg["r"]
    later_cfg.update(r=rank, lora_alpha=rank)  # scale alpha / r = 1: the B's carry the scales
    save_file(out, str(later_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (later_dir / ADAPTER_CONFIG).write_text(json.dumps(later_cfg, indent=2, sort_keys=True) + "\n")
