"""RCTP data: every trajectory labelled by the environment, tagged to match,
1:1 expert:failure, saved and reloaded exactly."""
import json

import pytest

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.config import parse_args
from rcgrpo.data.rctp import RctpDataError, build_rctp, load_records, save_records, summary
from rcgrpo.envs.bfcl import load_entries, split_train_test
from rcgrpo.model.loading import reward_token_ids
from rcgrpo.rollout.agent_loop import RolloutConfig

CFG = RolloutConfig(max_new_tokens=12, max_total_tokens=6144, doc_style="compact_no_response", progress=False)


def rctp(*flags):
    """The config's RCTP section with these flags."""
    return parse_args(list(flags), check_files=False).rctp


@pytest.fixture(scope="module")
def base_entries():
    train, _ = split_train_test(load_entries(["base"]))
    return train[:3]


def test_rctp_records_are_labelled_tagged_and_balanced(vllm_engine, tokenizer, base_entries, tmp_path):
    # failures come from real rollouts of the starting model (the shared vLLM engine)
    records = build_rctp(vllm_engine, base_entries, tokenizer, CFG, rctp("--rctp.failure_attempts", "1"), seed=0)
    kinds = summary(records)
    assert kinds["total"] == 6 and kinds["expert_high"] == 3
    assert kinds.get("failure_low", 0) + kinds.get("perturbed_low", 0) + kinds.get("perturbed_high", 0) == 3
    ids = reward_token_ids(tokenizer)
    for r in records:
        assert r.reward_token == (HIGH_REWARD if r.reward == 1.0 else LOW_REWARD)  # label from the reward
        prompt = r.token_ids[: r.sampled_mask.index(1)]
        assert prompt.count(ids[r.reward_token]) == 1
        assert len(r.token_ids) == len(r.sampled_mask) and sum(r.sampled_mask) > 0
    path = save_records(records, tmp_path / "rctp.jsonl")
    assert load_records(path) == records


def test_perturbed_experts_fill_missing_failures(tokenizer, base_entries):
    # With no rollout attempts no failure is collected: perturbed experts
    # fill the quota, each labelled by executing it.
    records = build_rctp(None, base_entries, tokenizer, CFG, rctp("--rctp.failure_attempts", "0"), seed=0)
    perturbed = [r for r in records if r.kind == "perturbed"]
    assert len(perturbed) == 3 and {r.entry_id for r in perturbed} == {e.id for e in base_entries}
    assert all(r.reward == 0.0 and r.reward_token == LOW_REWARD for r in perturbed)


def test_malformed_rctp_file_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"entry_id": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_records(bad)
    with pytest.raises(RctpDataError, match="missing"):
        load_records(tmp_path / "absent.jsonl")
    bad.write_bytes(b"\xff\xfe\n")
    with pytest.raises(RctpDataError, match="not UTF-8"):
        load_records(bad)
    bad.write_text("\n\n")
    with pytest.raises(RctpDataError, match="holds no records"):
        load_records(bad)


def test_a_file_with_the_old_mask_key_still_loads(tmp_path):
    """RCTP files written before Record.loss_mask became sampled_mask."""
    row = {"entry_id": "e", "kind": "expert", "reward": 1.0, "r_state": 1.0, "r_action": 1.0, "valid": True,
           "reward_token": HIGH_REWARD, "token_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "end_reason": "completed"}
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(row) + "\n")
    (record,) = load_records(old)
    assert record.sampled_mask == [0, 1, 1]
    save_records([record], tmp_path / "new.jsonl")
    assert load_records(tmp_path / "new.jsonl") == [record]
