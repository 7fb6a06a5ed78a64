"""vLLM's own logs in a run: warnings and errors, unless VLLM_LOGGING_LEVEL asks for more."""
import logging
import os
import subprocess
import sys

import pytest

from rcgrpo.rollout.vllm_engine import ENGINE_LOG_LEVEL, quiet_engine_logs


@pytest.mark.slow  # a fresh interpreter starts a vLLM engine on the embedded model (~15 s)
def test_an_engine_start_logs_vllms_warnings_but_not_its_info_lines():
    # Before: 19 INFO lines of 43 for this start (arguments, architecture, model length, ...).
    code = ("from rcgrpo.models import resolve_model_folder; from rcgrpo.rollout.vllm_engine import VLLMEngine; "
            "VLLMEngine(str(resolve_model_folder(None)), kv_cache_gib=1); print('engine started')")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "engine started" in out.stdout, out.stderr[-2000:]
    lines = (out.stdout + out.stderr).splitlines()
    assert not [line for line in lines if " INFO " in line], lines
    assert any(" WARNING " in line for line in lines)  # what vLLM warns about still shows


def test_a_level_the_user_set_is_kept(monkeypatch):
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", logging.INFO)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    quiet_engine_logs()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and vllm_logger.level == logging.INFO
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    quiet_engine_logs()
    assert os.environ["VLLM_LOGGING_LEVEL"] == ENGINE_LOG_LEVEL and vllm_logger.level == logging.WARNING
