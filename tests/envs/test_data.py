import json
import shutil

import pytest

from rcgrpo.envs.data import CATEGORIES, DataError, data_dir, load_category, load_entries


def test_all_four_categories_load_with_ground_truth(entries):
    assert len(entries) == 800
    for category in CATEGORIES:
        cat = [e for e in entries if e.category == category]
        assert len(cat) == 200
        assert sorted(e.index for e in cat) == list(range(200))
    for e in entries:
        assert len(e.ground_truth) == len(e.turns) > 0
        assert e.function_docs and all("name" in d for d in e.function_docs)


def test_miss_func_entries_name_their_held_out_functions(entries):
    miss = [e for e in entries if e.category == "miss_func"]
    assert all(e.missed_function for e in miss)
    for e in miss:
        names = {d["name"] for d in e.function_docs}
        for turn, held in e.missed_function.items():
            assert e.turns[turn] == []  # the reveal turn has no user text
            assert set(held) <= names


def _copy_data(tmp_path):
    root = tmp_path / "data"
    shutil.copytree(data_dir() / "multi_turn_func_doc", root / "multi_turn_func_doc")
    (root / "possible_answer").mkdir()
    for name in ("BFCL_v4_multi_turn_base.json",):
        shutil.copy(data_dir() / name, root / name)
        shutil.copy(data_dir() / "possible_answer" / name, root / "possible_answer" / name)
    return root


def test_malformed_data_file_names_file_and_line(tmp_path):
    root = _copy_data(tmp_path)
    path = root / "BFCL_v4_multi_turn_base.json"
    lines = path.read_text().splitlines()
    lines[3] = lines[3][: len(lines[3]) // 2]  # a truncated JSON line
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"malformed: .*BFCL_v4_multi_turn_base\.json:4"):
        load_category("base", root)


def test_missing_data_file_is_named(tmp_path):
    root = _copy_data(tmp_path)
    (root / "possible_answer" / "BFCL_v4_multi_turn_base.json").unlink()
    with pytest.raises(DataError, match=r"missing: .*possible_answer.*BFCL_v4_multi_turn_base\.json"):
        load_category("base", root)
    with pytest.raises(DataError, match="missing: .*miss_param"):
        load_entries(["miss_param"], root)


def test_ground_truth_turn_count_mismatch_is_an_error(tmp_path):
    root = _copy_data(tmp_path)
    path = root / "possible_answer" / "BFCL_v4_multi_turn_base.json"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["ground_truth"] = rows[0]["ground_truth"][:-1]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError, match="multi_turn_base_0"):
        load_category("base", root)
