"""Checkpoints: exact round trip, atomicity, corruption detection and fallback."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from rcgrpo.model.loading import load_model_weights
from rcgrpo.run.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    _write_manifest,
    list_checkpoints,
    load_latest,
    save_checkpoint,
    verify_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


def tiny_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|im_end|>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>")


def train_steps(model, opt, sched, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 64, (2, 9), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def make_run(seed=0):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def save(root, step, model=None, **kw):
    model = model if model is not None else tiny_model()
    return save_checkpoint(root, step, model, **kw)


def test_round_trip_is_exact(tmp_path):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 2, seed=1)
    gen = torch.Generator().manual_seed(123)
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    tok = tiny_tokenizer()
    cfg = {"grpo": {"lr": 1e-6}}
    path = save_checkpoint(tmp_path, 2, model, tok, opt, sched, stage="rctp", data_position={"epoch": 1, "index": 4},
                           config=cfg, extra={"note": "x"}, generators={"rollout": gen})
    assert path.name == "ckpt-00000002" and (tmp_path / "latest").read_text().strip() == path.name
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=gen).item())
    expected_state = {k: v.clone() for k, v in model.state_dict().items()}

    # Continue the original for reference, then restore into fresh objects.
    train_steps(model, opt, sched, 1, seed=2)
    reference_after = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = make_run(seed=99)
    gen2 = torch.Generator()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ck = load_latest(tmp_path)
    assert (ck.step, ck.stage, ck.data_position, ck.extra, ck.config) == (2, "rctp", {"epoch": 1, "index": 4},
                                                                           {"note": "x"}, cfg)
    load_model_weights(model2, ck.model_dir)
    ck.restore(opt2, sched2, generators={"rollout": gen2})
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected_state[k]), k
    assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()  # still tied
    draws = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=gen2).item())
    assert draws == expected_draws
    assert sched2.state_dict()["last_epoch"] == 2
    train_steps(model2, opt2, sched2, 1, seed=2)  # same step as the reference: optimizer state was exact
    for k, v in model2.state_dict().items():
        assert torch.equal(v, reference_after[k]), k


def test_model_folder_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_model()
    path = save_checkpoint(tmp_path, 0, model, tiny_tokenizer())
    loaded = AutoModelForCausalLM.from_pretrained(str(path / "model"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert (path / "model" / "model.safetensors").is_file()
    assert AutoTokenizer.from_pretrained(str(path / "model")).convert_tokens_to_ids("w3") == 5


@pytest.fixture
def three(tmp_path):
    model = tiny_model()
    for step in (10, 20, 30):
        save(tmp_path, step, model)
    return tmp_path


def _load_warned(root):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ck = load_latest(root)
    return ck, [str(x.message) for x in w if issubclass(x.category, CheckpointWarning)]


def test_truncated_weights_fall_back(three):
    st = three / "ckpt-00000030" / "model" / "model.safetensors"
    with open(st, "r+b") as f:
        f.truncate(st.stat().st_size // 2)
    ck, msgs = _load_warned(three)
    assert ck.step == 20
    assert len(msgs) == 1 and str(st) in msgs[0] and "truncated" in msgs[0]


def test_flipped_byte_falls_back(three):
    st = three / "ckpt-00000030" / "state.json"
    data = bytearray(st.read_bytes())
    data[-2] ^= 1
    st.write_bytes(bytes(data))
    ck, msgs = _load_warned(three)
    assert ck.step == 20 and "sha256" in msgs[0] and str(st) in msgs[0]


def test_missing_manifest_falls_back(three):
    (three / "ckpt-00000030" / "MANIFEST.json").unlink()
    ck, msgs = _load_warned(three)
    assert ck.step == 20 and "MANIFEST.json is missing" in msgs[0]


def test_leftover_tmp_is_reported_and_ignored(three):
    (three / "ckpt-00000040.tmp" / "model").mkdir(parents=True)
    ck, msgs = _load_warned(three)
    assert ck.step == 30
    assert any("ckpt-00000040.tmp" in m and "interrupted" in m for m in msgs)
    save(three, 40)  # the next save clears it
    assert not (three / "ckpt-00000040.tmp").exists() and load_latest(three).step == 40


def _remanifest(folder):
    """The manifest a save would write for the folder as it is now."""
    (folder / "MANIFEST.json").unlink()
    _write_manifest(folder, 30)


def _rewrite_manifest(folder, edit):
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    edit(manifest)
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("tamper, says", [
    # a file the save did not write
    (lambda d: (d / "model" / "extra.safetensors").write_bytes(b"\0" * 64), "not listed in the manifest"),
    # a listed path that climbs out of the folder (the file exists there)
    (lambda d: ((d.parent / "outside.json").write_text("{}"),
                _rewrite_manifest(d, lambda m: m["files"].update({"../outside.json": {"size": 2, "sha256": "x"}}))),
     "outside the checkpoint folder"),
    (lambda d: _rewrite_manifest(d, lambda m: m.update(files=["state.json"])), "malformed"),
    (lambda d: _rewrite_manifest(d, lambda m: m["files"].update({"state.json": [1, 2]})), "malformed"),
    (lambda d: (d / "MANIFEST.json").write_text("[" * 100_000), "unreadable"),
    # metadata that verifies (the manifest made anew) but has the wrong shape
    (lambda d: ((d / "state.json").write_text('{"step": "thirty"}'), _remanifest(d)), "integer 'step'"),
    (lambda d: ((d / "state.json").write_text('["step", 30]'), _remanifest(d)), "integer 'step'"),
    (lambda d: ((d / "state.json").write_text('{"step": 30, "extra": 5}'), _remanifest(d)), "wrong types"),
])
def test_a_tampered_or_malformed_checkpoint_falls_back_with_a_warning(three, tamper, says):
    tamper(three / "ckpt-00000030")
    ck, msgs = _load_warned(three)
    assert ck.step == 20
    assert len(msgs) == 1 and "ckpt-00000030" in msgs[0] and says in msgs[0], msgs


def test_nothing_usable_is_an_error(three):
    for p in list_checkpoints(three):
        (p / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_latest(three)


def test_empty_or_absent_root(tmp_path):
    assert load_latest(tmp_path / "none") is None
    assert load_latest(tmp_path) is None


def test_failed_save_loses_nothing(three):
    before = {p.name: json.loads((p / "MANIFEST.json").read_text()) for p in list_checkpoints(three)}

    class Exploding(torch.optim.SGD):
        def state_dict(self):
            raise RuntimeError("disk full")

    model = tiny_model()
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(three, 40, model, optimizer=Exploding(model.parameters(), lr=0.1))
    assert not (three / "ckpt-00000040.tmp").exists() and not (three / "ckpt-00000040").exists()
    assert (three / "latest").read_text().strip() == "ckpt-00000030"
    after = {p.name: json.loads((p / "MANIFEST.json").read_text()) for p in list_checkpoints(three)}
    assert after == before
    for p in list_checkpoints(three):
        verify_checkpoint(p)


def test_keep_last_and_resave(tmp_path):
    model = tiny_model()
    for step in range(5):
        save(tmp_path, step, model, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000003", "ckpt-00000004"]
    save(tmp_path, 4, model, keep_last=2, extra={"again": True})  # same step: replaced
    assert load_latest(tmp_path).extra == {"again": True}
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000003", "ckpt-00000004"]


def test_non_json_metadata_is_refused_before_writing(tmp_path):
    with pytest.raises(TypeError):
        save(tmp_path, 1, data_position={1, 2})
    assert list(tmp_path.iterdir()) == []


def test_restore_missing_part_is_clear(tmp_path):
    save(tmp_path, 1)
    model, opt, _ = make_run()
    with pytest.raises(CheckpointError, match="optimizer.pt is missing"):
        load_latest(tmp_path).restore(optimizer=opt)


@pytest.mark.slow  # a subprocess killed at every line of a save (~10 s)
def test_kill_at_every_line_of_a_save_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """A real process is SIGKILLed just before each distinct line a save runs
    (tests/crashpoints.py), for a new step and for a re-save of a step; the
    survivor's load_latest then returns the newest complete checkpoint, with
    exactly the weights that were saved, and the next save works."""
    from tests.crashpoints import line_of

    proc = subprocess.run([sys.executable, "-m", "tests.crashpoints", "sweep", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    manifest_written = line_of("(folder / MANIFEST).write_text(json.dumps(manifest, indent=2))", "_write_manifest")
    for scenario, (old_seed, new_seed) in {"new-step": (1, 2), "re-save": (2, 3)}.items():
        mine = [r for r in rows if r["scenario"] == scenario]
        assert len(mine) > 40, mine  # every line of save_checkpoint and its helpers
        complete_after = [r["line"] for r in mine].index(manifest_written)
        for i, row in enumerate(mine):
            assert row["killed"] and "error" not in row, row
            assert row["seed"] == (new_seed if i > complete_after else old_seed), row
            assert row["weights_match_seed"] and row["next_save_loads"], row
    between = [r for r in rows if r["scenario"] == "re-save"
               and {"ckpt-00000002.old", "ckpt-00000002.tmp"} <= set(r["on_disk"]) and "ckpt-00000002" not in r["on_disk"]]
    assert between and all(r["seed"] == 3 for r in between), between


def _fake_save(root, step, seed):
    return save(root, step, tiny_model(seed), extra={"seed": seed})


def test_recovery_between_the_two_renames(tmp_path):
    # ckpt-5 moved aside to .old, the complete new save still in .tmp
    _fake_save(tmp_path / "new", 5, seed=1)
    _fake_save(tmp_path / "old", 5, seed=2)
    os.rename(tmp_path / "new" / "ckpt-00000005", tmp_path / "ckpt-00000005.tmp")
    os.rename(tmp_path / "old" / "ckpt-00000005", tmp_path / "ckpt-00000005.old")
    with pytest.warns(CheckpointWarning, match="ckpt-00000005.tmp was complete"):
        ck = load_latest(tmp_path)
    assert ck.step == 5 and ck.extra == {"seed": 1}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt-00000005"]


def test_recovery_restores_old_when_the_new_save_is_incomplete(tmp_path):
    _fake_save(tmp_path / "new", 5, seed=1)
    _fake_save(tmp_path / "old", 5, seed=2)
    os.rename(tmp_path / "new" / "ckpt-00000005", tmp_path / "ckpt-00000005.tmp")
    (tmp_path / "ckpt-00000005.tmp" / "MANIFEST.json").unlink()  # killed before the manifest
    os.rename(tmp_path / "old" / "ckpt-00000005", tmp_path / "ckpt-00000005.old")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = load_latest(tmp_path)
    assert ck.step == 5 and ck.extra == {"seed": 2}
    assert any("restored as ckpt-00000005" in str(w.message) for w in caught)


DISK_FULL_SAVE = """
import resource, signal, sys
from pathlib import Path
from rcgrpo.run.checkpoint import save_checkpoint
from rcgrpo.base.errors import run_command
from tests.run.test_checkpoint import make_run, train_steps

root, part = Path(sys.argv[1]), sys.argv[2]
model, opt, sched = make_run()
train_steps(model, opt, sched, 2, seed=0)  # the optimizer has state: optimizer.pt outweighs the weights
first = save_checkpoint(root, 1, model, optimizer=opt, scheduler=sched)
weights = (first / "model" / "model.safetensors").stat().st_size
# Writes past the limit fail with EFBIG (SIGXFSZ ignored, as a full disk fails
# them with ENOSPC): below the weights' size the safetensors write fails, just
# above it torch.save's of the optimizer state.
limit = 1024 if part == "weights" else weights + 1
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
sys.exit(run_command("rcgrpo.train", lambda argv: save_checkpoint(root, 2, model, optimizer=opt, scheduler=sched)
                     and 0, []))
"""


@pytest.mark.slow  # a fresh interpreter under a file-size limit, per part (~6 s each)
@pytest.mark.parametrize("part, reason", [("weights", "File too large"),
                                          ("optimizer", "a write failed (the disk full, or a file-size limit)")])
def test_a_save_that_runs_out_of_space_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, part, reason):
    """A real failed write (RLIMIT_FSIZE in a subprocess), in the safetensors
    writer or in torch.save. Before: internal error: SafetensorError /
    RuntimeError ("unexpected pos ..."), exit 1."""
    root = tmp_path / "ckpts"
    env = {k: v for k, v in os.environ.items() if k != "RCGRPO_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", DISK_FULL_SAVE, str(root), part], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rcgrpo.train: ")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0] == (f"rcgrpo.train: error: checkpoint step 2 could not be written to {root}: {reason}; "
                        f"the previous checkpoint {root / 'ckpt-00000001'} is intact (free space there, then --resume)")
    assert [p.name for p in list_checkpoints(root)] == ["ckpt-00000001"]
    assert not (root / "ckpt-00000002.tmp").exists() and (root / "latest").read_text().strip() == "ckpt-00000001"
    verify_checkpoint(root / "ckpt-00000001")
    assert load_latest(root).step == 1


DISK_FULL_EXPORT = """
import resource, signal, sys
from pathlib import Path
import torch
from rcgrpo.config import parse_args
from rcgrpo.base.errors import run_command
from rcgrpo.pipeline.run import Run
from tests.run.test_checkpoint import tiny_model, tiny_tokenizer

cfg = parse_args(["--out-dir", sys.argv[1], "--name", "r"], check_files=False)
ctx = Run(cfg, torch.device("cpu"), tiny_tokenizer(), Path("."))
model = tiny_model()
ctx._replace_model_dir("rctp", model.save_pretrained)  # the stage's model, exported once
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
sys.exit(run_command("rcgrpo.train", lambda argv: ctx._replace_model_dir("rctp", model.save_pretrained) and 0, []))
"""


@pytest.mark.slow  # a fresh interpreter under a file-size limit (~6 s)
def test_a_stage_model_export_that_runs_out_of_space_is_one_line_and_keeps_the_previous_one(tmp_path):
    """The same for a stage's exported model (the safetensors writer under a
    real file-size limit). Before: internal error: SafetensorError, exit 1."""
    env = {k: v for k, v in os.environ.items() if k != "RCGRPO_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", DISK_FULL_EXPORT, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rcgrpo.train: ")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    models = tmp_path / "r" / "models"
    assert lines[0] == (f"rcgrpo.train: error: the model of stage rctp could not be written to {models / 'rctp.tmp'}: "
                        "File too large (free space there, then --resume)")
    assert sorted(p.name for p in models.iterdir()) == ["rctp"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(models / "rctp")  # the earlier export loads


def test_write_failure_reads_the_errno_the_writers_wrap():
    """ENOSPC cannot be produced here without root (no small filesystem to
    fill); RLIMIT_FSIZE above produces EFBIG through the same wrappers. The
    safetensors text for a full disk carries errno 28 the same way."""
    from safetensors import SafetensorError

    from rcgrpo.run.checkpoint import write_failure

    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_failure(full) == os.strerror(28)
    assert write_failure(OSError(28, "No space left on device")) == "No space left on device"
    assert write_failure(SafetensorError("Error while serializing: header too large")) is None  # not a write
    assert write_failure(RuntimeError("shape mismatch")) is None and write_failure(KeyError("x")) is None
