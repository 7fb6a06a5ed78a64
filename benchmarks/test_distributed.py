"""Update-phase throughput at 1 process vs 2 torchrun ranks (FSDP2 over gloo
on CPU, NCCL on GPU), in the same run, on the same global batch: one RC-GRPO
update (reference log-probs, loss, backward, global-norm clip, AdamW step,
the full-weight stream the engine loads) on fixed rollouts of the small
model. On the 2-core CPU machine the two ranks share the cores, so the
ratio shows the cost of sharding and of the collectives, not a speed-up
(reported, not held).

Sizes (``benchmarks/scale.py``): full, 8 groups; smoke, 2 groups. The quick
default leaves it out: on one 2-core machine it answers how much sharding
costs, not how fast we train.
"""
import json

import pytest

from benchmarks import scale
from benchmarks.scoreboard import Comparison
from tests.distributed.conftest import python, torchrun
from tests.distributed.update_worker import build_rollouts

GROUPS = scale.pick(smoke=2, quick=0, full=8)
RESULTS: dict = {}
WORKER = ["-m", "tests.distributed.update_worker"]
pytestmark = [pytest.mark.benchmark(group="distributed: update phase, 1 process vs 2 ranks"),
              pytest.mark.skipif(GROUPS == 0, reason="runs in the full sweep only (--full)")]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    from rcgrpo.model.loading import load_tokenizer, resolve_model_folder

    path = tmp_path_factory.mktemp("dist") / "rollouts.jsonl"
    return build_rollouts(load_tokenizer(resolve_model_folder(None)), path, groups=GROUPS)


def run_update(ranks: int, rollouts, out) -> dict:
    args = WORKER + [str(rollouts), str(out)]
    proc = python(args, timeout=900) if ranks == 1 else torchrun(ranks, args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "stats.json").read_text())


@pytest.mark.parametrize("ranks", [1, 2])
def test_update_phase(benchmark, board, ranks, rollouts, tmp_path):
    stats = benchmark.pedantic(lambda: run_update(ranks, rollouts, tmp_path / f"r{ranks}"), rounds=1, iterations=1)
    benchmark.extra_info.update(update_s=stats["update_s"], tokens_per_s=stats["tokens_per_s"],
                                batch_tokens=stats["batch_tokens"])
    RESULTS[ranks] = stats
    if ranks == 2 and 1 in RESULTS:
        one = RESULTS[1]
        board.record(Comparison(group="distributed", name="update phase", ours="2 ranks (FSDP2, gloo)",
                                peer="1 process", ours_s=stats["update_s"], peer_s=one["update_s"], per="update",
                                shape=f"cpu fp32 135M, {GROUPS} groups, {one['batch_tokens']} tokens"))
