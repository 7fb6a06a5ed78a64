"""Rollout: engines that turn token ids into token ids, and the multi-turn agent loop."""

from __future__ import annotations

import logging
import os
import warnings

from rcgrpo.rollout.engine import Engine, Generation, SamplingConfig

log = logging.getLogger(__name__)

__all__ = ["ENGINES", "Engine", "Generation", "SamplingConfig", "make_engine", "vllm_available"]

# The engine kinds make_engine builds (run.engine, eval --engine).
ENGINES = ("auto", "vllm", "hf")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def make_engine(kind: str, model_path: str | os.PathLike, *, loaded=None, **vllm_kwargs) -> Engine:
    """kind: "vllm", "hf", or "auto" (vLLM when importable, else HF with a notice).

    `loaded` (a rcgrpo.model.loading.LoadedModel) is the model the HF engine
    generates with; when absent it is loaded from `model_path`. (`policy=`,
    its old name, is read for one release.)
    """
    if "policy" in vllm_kwargs:
        warnings.warn("make_engine(policy=...) is now make_engine(loaded=...); the old name goes in rcgrpo 0.2",
                      DeprecationWarning, stacklevel=2)
        loaded = vllm_kwargs.pop("policy")
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}: auto, vllm or hf")
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
        if kind == "hf":
            log.warning("rcgrpo: vLLM is not installed; rollouts use the slower transformers engine")
    if kind == "vllm":
        from rcgrpo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **vllm_kwargs)
    from rcgrpo.rollout.hf_engine import HFEngine

    if loaded is None:
        from rcgrpo.model.loading import load_policy

        loaded = load_policy(model_path)
    return HFEngine(loaded.model, loaded.tokenizer)
