"""Without torchrun nothing distributed happens: every helper answers for a
world of one. And the slicing rule that decides who trains on what."""
import pytest

from rcgrpo.base import distributed
from rcgrpo.config import ConfigError, parse_args


def test_without_torchrun_the_helpers_are_a_world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    world = distributed.init("cpu")
    assert world == distributed.World(0, 1, 0, None) and not distributed.active()
    assert distributed.rank() == 0 and distributed.world_size() == 1 and distributed.is_main()
    assert distributed.all_reduce_sum({"a": 1.5, "b": 2}) == {"a": 1.5, "b": 2}
    assert distributed.all_reduce_max(3) == 3
    assert distributed.all_gather_objects([1, 2]) == [[1, 2]]
    assert distributed.broadcast_object("x") == "x"
    with pytest.raises(distributed.DistributedError, match="torchrun"):
        distributed.shard_model(object())


# What an in-process vLLM engine does in a plain `python -m rcgrpo.train`.
FOREIGN_GROUP = """
import socket, torch, torch.distributed as dist
from rcgrpo.base import distributed
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
layer = torch.nn.Linear(2, 2)
# TrainablePolicy.load shards only inside an active torchrun world.
assert not distributed.active(), "a group of one made by someone else is not a torchrun world"
assert not distributed.is_sharded(layer)
print("plain")
"""


@pytest.mark.slow  # a subprocess imports vLLM to make its group (~3 s)
def test_a_process_group_made_by_vllm_is_not_a_torchrun_world():
    from tests.distributed.conftest import python

    out = python(["-c", FOREIGN_GROUP])
    assert out.returncode == 0 and out.stdout.strip() == "plain", out.stderr[-2000:]


@pytest.mark.parametrize("n,world", [(8, 2), (5, 2), (1, 2), (7, 3), (2, 4)])
def test_rank_slices_cover_the_step_once_in_order(n, world):
    items = list(range(n))
    spans = [distributed.rank_slice(items, world, r) for r in range(world)]
    assert [i for lo, hi in spans for i in items[lo:hi]] == items
    sizes = [hi - lo for lo, hi in spans]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_world_settings_are_validated_against_the_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="run.engine_tp_size 2 must divide the torchrun world size 3"):
        parse_args(["--run.engine_tp_size", "2", "--run.engine", "vllm", "--device", "cuda"], check_files=False)
    with pytest.raises(ConfigError, match="run.engine_tp_size 2 needs run.engine vllm and run.device cuda"):
        parse_args(["--run.engine_tp_size", "2"], check_files=False)
    with pytest.raises(ConfigError, match="run.dist_timeout_s must be > 0"):
        parse_args(["--run.dist_timeout_s", "0"], check_files=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = parse_args(["--run.engine_tp_size", "2", "--run.engine", "vllm", "--device", "cuda"], check_files=False)
    assert cfg.run.engine_tp_size == 2
