"""models.py: the embedded default, reward tokens, the cache, clear errors."""
import json
import multiprocessing as mp
import shutil
import time
from pathlib import Path

import pytest
import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD, REWARD_TOKEN_PHRASES
from rcgrpo.model import loading as models
from rcgrpo.model.loading import ModelFolderError


def test_embedded_policy_has_distinct_phrase_mean_reward_rows_and_tied_embeddings(policy):
    model, tok = policy.model, policy.tokenizer
    ids = models.reward_token_ids(tok)
    assert sorted(ids.values()) == [49152, 49153]  # appended after SmolLM2's 49,152
    # Each is one special token, never split, wherever it appears.
    assert tok("goal: <|high_reward|>.", add_special_tokens=False)["input_ids"].count(ids[HIGH_REWARD]) == 1
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == len(tok) == model.config.vocab_size == 49154
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    for t, phrase in REWARD_TOKEN_PHRASES.items():
        phrase_ids = tok(phrase, add_special_tokens=False)["input_ids"]
        assert phrase_ids and max(phrase_ids) < 49152
        # The copy is fp32 like the dequantized GGUF: no rounding to undo.
        torch.testing.assert_close(emb[ids[t]], emb[phrase_ids].mean(0), atol=1e-6, rtol=0)
    high, low = emb[ids[HIGH_REWARD]], emb[ids[LOW_REWARD]]
    assert torch.isfinite(high).all() and torch.isfinite(low).all()
    assert torch.nn.functional.cosine_similarity(high, low, dim=0) < 0.99
    assert _saved_dtypes(policy.path) == {torch.float32}


def _saved_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def _saved_dtypes(folder: Path) -> set:
    return {t.dtype for t in _saved_tensors(folder).values()}


_TOY_WORDS = ["high", "low", "reward", "tool", "call", "user", "answer", *(f"item{c}" for c in "abcdefghijklmnop")]


def _toy_tokenizer():
    """A byte-level BPE like Qwen's: AutoTokenizer reloads it as a Qwen2Tokenizer."""
    import random

    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(_TOY_WORDS) for _ in range(12)) for _ in range(200)]
    inner = Tokenizer(tok_models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def _toy_model(vocab_size: int, tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _toy_folder(path: Path, spare_rows: int, tied: bool) -> tuple[Path, int]:
    """A tiny bf16 Qwen2 whose embedding has `spare_rows` rows beyond its tokenizer."""
    tok = _toy_tokenizer()
    _toy_model(len(tok) + spare_rows, tied).to(torch.bfloat16).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path, len(tok)


@pytest.mark.parametrize("spare_rows, tied", [(64, False), (0, False), (0, True), (64, True)])
def test_toy_model_gets_phrase_mean_rows_without_shrinking_or_rounding(tmp_path, monkeypatch, spare_rows, tied):
    monkeypatch.setenv("RCGRPO_CACHE", str(tmp_path / "cache"))
    source, n_tok = _toy_folder(tmp_path / "toy", spare_rows, tied)
    before = _saved_tensors(source)

    folder = models.resolve_model_folder(source)
    assert folder != source and folder.is_relative_to(tmp_path / "cache")
    assert folder.name.endswith(f"-rc-v{models._FORMAT_VERSION}")
    after = _saved_tensors(folder)
    assert _saved_dtypes(folder) == {torch.bfloat16}
    rows = n_tok + max(spare_rows, 2)  # spare rows are reused, never cut
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == rows

    tok = models.load_tokenizer(folder)
    ids = models.reward_token_ids(tok)
    assert [ids[HIGH_REWARD], ids[LOW_REWARD]] == [n_tok, n_tok + 1]
    keys = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    for key in keys:
        old, new = before[key], after[key]
        assert new.shape[0] == rows
        for t, phrase in REWARD_TOKEN_PHRASES.items():
            phrase_ids = tok(phrase, add_special_tokens=False)["input_ids"]
            assert len(phrase_ids) == 2
            torch.testing.assert_close(new[ids[t]].float(), old[phrase_ids].float().mean(0), rtol=2**-8, atol=0)
        others = [i for i in range(old.shape[0]) if i not in ids.values()]
        assert torch.equal(new[others], old[others])
        assert not torch.equal(new[ids[HIGH_REWARD]], new[ids[LOW_REWARD]])

    policy = models.load_policy(folder)
    assert isinstance(policy, models.LoadedModel)
    emb = policy.model.get_input_embeddings().weight
    assert emb.shape[0] == policy.model.config.vocab_size == rows
    head_is_emb = policy.model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    assert head_is_emb == tied


def _word_tokenizer(vocab: list[str], unk: bool):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = ["<eos>", *(["[UNK]"] if unk else []), *vocab]
    ids = {w: i for i, w in enumerate(vocab)}
    # BPE without merges or unk drops what it cannot spell: the "nothing" case.
    inner = Tokenizer(tok_models.WordLevel(ids, unk_token="[UNK]") if unk else tok_models.BPE(ids, []))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", unk_token="[UNK]" if unk else None)


@pytest.mark.parametrize("vocab, unk, message", [
    (["high", "low"], True, "unknown token"),  # "reward" is missing
    (["x"], False, "tokenises to nothing"),
])
def test_reward_phrase_the_tokenizer_cannot_spell_is_a_clear_error(vocab, unk, message):
    tok = _word_tokenizer(vocab, unk)
    model = _toy_model(len(tok), tied=False)
    n_tok, before = len(tok), model.get_input_embeddings().weight.clone()
    with pytest.raises(ModelFolderError, match=message):
        models._add_reward_tokens(model, tok)
    # Checked before anything changed: neither the tokenizer nor the model is half-extended.
    assert len(tok) == n_tok
    assert torch.equal(model.get_input_embeddings().weight, before)


def test_second_resolve_reuses_the_cache(policy):
    start = time.perf_counter()
    assert models.resolve_model_folder() == policy.path
    assert models.resolve_model_folder(models.EMBEDDED) == policy.path
    assert time.perf_counter() - start < 5  # no reconversion (that takes ~20 s)
    assert (policy.path / "rcgrpo_model.json").is_file()
    assert (policy.path / "tokenizer.json").is_file()
    assert not (policy.path / "config.json").read_text().count("gguf")  # plain checkpoint


def test_policy_is_the_old_name_of_loaded_model():
    """A loaded model + tokenizer is a LoadedModel (the trained policy is
    rcgrpo.model.policy.TrainablePolicy); `Policy` still names it, for one
    release, with a warning."""
    with pytest.warns(DeprecationWarning, match="LoadedModel"):
        assert models.Policy is models.LoadedModel
    with pytest.raises(AttributeError):
        models.NoSuchName  # noqa: B018


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


@pytest.mark.slow  # two spawned interpreters import rcgrpo.model.loading (~2-2.5 s)
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
