"""models.py: the embedded default, reward tokens, the cache, clear errors."""
import multiprocessing as mp
import shutil
import time
from pathlib import Path

import pytest
import torch

from rcgrpo import models
from rcgrpo.models import HIGH_REWARD, LOW_REWARD, ModelFolderError


def test_embedded_policy_has_reward_tokens_with_mean_rows_and_tied_embeddings(policy):
    model, tok = policy.model, policy.tokenizer
    ids = models.reward_token_ids(tok)
    assert sorted(ids.values()) == [49152, 49153]  # appended after SmolLM2's 49,152
    # Each is one special token, never split, wherever it appears.
    assert tok("goal: <|high_reward|>.", add_special_tokens=False)["input_ids"].count(ids[HIGH_REWARD]) == 1
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == len(tok) == model.config.vocab_size == 49154
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    mean = emb[:49152].mean(0)
    for t in (HIGH_REWARD, LOW_REWARD):
        # bf16 on disk: the stored row is the mean rounded to bf16.
        torch.testing.assert_close(emb[ids[t]], mean.to(torch.bfloat16).float(), atol=2e-3, rtol=1e-2)


def test_second_resolve_reuses_the_cache(policy):
    start = time.perf_counter()
    assert models.resolve_model_folder() == policy.path
    assert models.resolve_model_folder(models.EMBEDDED) == policy.path
    assert time.perf_counter() - start < 5  # no reconversion (that takes ~20 s)
    assert (policy.path / "rcgrpo_model.json").is_file()
    assert (policy.path / "tokenizer.json").is_file()
    assert not (policy.path / "config.json").read_text().count("gguf")  # plain checkpoint


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        models.resolve_model_folder(tmp_path / "nope")
    with pytest.raises(ModelFolderError, match="does not exist"):
        models.load_policy("./no/such/model")


def test_corrupt_folder_is_a_clear_error(policy, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(policy.path, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 20])  # truncated copy
    with pytest.raises(ModelFolderError, match="corrupt or truncated"):
        models.load_policy(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="config.json"):
        models.check_model_folder(bad)


def test_incomplete_cache_folder_is_reported_not_reused(tmp_path):
    final = tmp_path / "models" / "x"
    final.mkdir(parents=True)  # exists, but no completion marker
    with pytest.raises(ModelFolderError, match="not a complete conversion"):
        models._save_atomically(lambda out: None, final, source="test")


def _race(final, log):
    def build(out: Path):
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # widen the window in which a second builder could start
        (out / "payload").write_text("ok")

    models._save_atomically(build, Path(final), source="race")


def test_two_processes_build_the_folder_once(tmp_path):
    final, log = tmp_path / "models" / "m", tmp_path / "log"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_race, args=(str(final), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert log.read_text().count("built") == 1
    assert (final / "payload").read_text() == "ok"
    assert [p.name for p in final.parent.iterdir() if ".tmp-" in p.name] == []
