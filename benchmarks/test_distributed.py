"""Update-phase throughput at 1 process vs 2 torchrun ranks (FSDP2 over gloo
on CPU, NCCL on GPU), in the same run, on the same global batch: one RC-GRPO
update (reference log-probs, loss, backward, global-norm clip, AdamW step,
the full-weight stream the engine loads) on fixed rollouts of the small
model. On the 2-core CPU machine the two ranks share the cores, so the
ratio shows the cost of sharding and of the collectives, not a speed-up.

Run: pytest benchmarks/test_distributed.py --benchmark-only -s
"""
import json

import pytest

from tests.distributed.conftest import python, torchrun
from tests.distributed.update_worker import build_rollouts

RESULTS: dict = {}
WORKER = ["-m", "tests.distributed.update_worker"]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    from rcgrpo.models import load_tokenizer, resolve_model_folder

    path = tmp_path_factory.mktemp("dist") / "rollouts.jsonl"
    return build_rollouts(load_tokenizer(resolve_model_folder(None)), path, groups=8)


def run_update(ranks: int, rollouts, out) -> dict:
    args = WORKER + [str(rollouts), str(out)]
    proc = python(args, timeout=900) if ranks == 1 else torchrun(ranks, args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "stats.json").read_text())


@pytest.mark.parametrize("ranks", [1, 2])
def test_update_phase(benchmark, ranks, rollouts, tmp_path):
    stats = benchmark.pedantic(lambda: run_update(ranks, rollouts, tmp_path / f"r{ranks}"), rounds=1, iterations=1)
    benchmark.extra_info.update(update_s=stats["update_s"], tokens_per_s=stats["tokens_per_s"],
                                batch_tokens=stats["batch_tokens"])
    RESULTS[ranks] = stats
    if len(RESULTS) == 2:
        one, two = RESULTS[1], RESULTS[2]
        print(f"\nupdate phase, {one['batch_tokens']} tokens: 1 process {one['tokens_per_s']:.0f} tok/s "
              f"({one['update_s']:.1f} s), 2 ranks {two['tokens_per_s']:.0f} tok/s ({two['update_s']:.1f} s); "
              f"2-rank / 1-process = {two['tokens_per_s'] / one['tokens_per_s']:.2f}")
