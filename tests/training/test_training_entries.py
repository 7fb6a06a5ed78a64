"""`data.entry_ids`: train on named entries; a wrong id is named, never ignored."""
import pytest

from rcgrpo.config import parse_args
from rcgrpo.envs.split import recorded_test_ids
from rcgrpo.model.loading import load_tokenizer, resolve_model_folder
from rcgrpo.train import training_entries


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_folder(None))


@pytest.mark.slow  # tokenises every base training entry's prompt (~4 s)
def test_entry_ids_select_exactly_those_whatever_the_subset(tokenizer):
    ids = "multi_turn_base_104,multi_turn_base_100,multi_turn_base_132"
    cfg = parse_args(["--data.categories", "base", "--data.entry_ids", ids, "--data.train_subset", "1"])
    # An explicit list wins: a subset setting (from a preset or a flag) drops none of it.
    assert [e.id for e in training_entries(cfg, tokenizer)] == sorted(ids.split(","))
    assert len(training_entries(parse_args(["--data.categories", "base", "--data.train_subset", "3",
                                            "--data.entry_ids", "none"]), tokenizer)) == 3


@pytest.mark.parametrize("bad, needle", [("no_such_entry", "not training entries"), (None, "not training entries")])
def test_unknown_or_held_out_ids_are_named(tokenizer, bad, needle):
    bad = bad or f"multi_turn_base_{recorded_test_ids()[0]}"  # held out for the test split
    cfg = parse_args(["--data.categories", "base", "--data.entry_ids", f"multi_turn_base_100,{bad}"])
    with pytest.raises(SystemExit, match=needle) as e:
        training_entries(cfg, tokenizer)
    assert bad in str(e.value)


def test_named_entry_over_the_prompt_budget_is_named(tokenizer):
    cfg = parse_args(["--data.categories", "base", "--data.entry_ids", "multi_turn_base_100",
                      "--data.max_prompt_tokens", "500", "--grpo.max_total_tokens", "4096"])
    with pytest.raises(SystemExit, match="over data.max_prompt_tokens=500"):
        training_entries(cfg, tokenizer)
