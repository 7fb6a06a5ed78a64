"""The presets (rcgrpo/config/presets.py, presets.toml): the default one
applies whatever the model, each is valid, each is data in dotted keys."""

from __future__ import annotations

from rcgrpo import config as C
from rcgrpo.config import parse_args


def test_the_default_preset_applies_whatever_the_model(tmp_path):
    """Before, naming a model dropped the preset: a laptop's `--model ./folder`
    started 720 entries x 400 steps. The size changes only with --preset."""
    size = lambda cfg: (cfg.preset, cfg.grpo.steps, cfg.grpo.batch_size, cfg.data.entry_ids)
    bare = size(parse_args([]))
    assert bare[:2] == ("cpu-small", C.PRESETS["cpu-small"]["grpo.steps"])
    assert size(parse_args(["--model", "owner/name"], check_files=False)) == bare
    (tmp_path / "model.toml").write_text('[model]\nname_or_path = "owner/name"\n')
    assert size(parse_args(["--config", str(tmp_path / "model.toml")], check_files=False)) == bare
    assert parse_args(["--preset", "none", "--model", "owner/name"], check_files=False).grpo.batch_size == 256
    assert parse_args(["--preset", "none"]).preset is None


def test_every_preset_is_valid():
    for name in C.PRESETS:
        cfg = parse_args(["--preset", name], check_files=False)
        assert cfg.preset == name


def test_presets_are_data_in_dotted_keys():
    for name, values in C.PRESETS.items():
        assert set(values) <= set(C.all_keys()), name
