"""vLLM's own logs in a run: warnings and errors, unless VLLM_LOGGING_LEVEL asks for more
(that an engine start then logs no INFO line: tests/distributed/test_engine_per_rank.py)."""
import logging
import os

from rcgrpo.rollout.vllm_engine import ENGINE_LOG_LEVEL, quiet_engine_logs


def test_a_level_the_user_set_is_kept(monkeypatch):
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", logging.INFO)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    quiet_engine_logs()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and vllm_logger.level == logging.INFO
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    quiet_engine_logs()
    assert os.environ["VLLM_LOGGING_LEVEL"] == ENGINE_LOG_LEVEL and vllm_logger.level == logging.WARNING
