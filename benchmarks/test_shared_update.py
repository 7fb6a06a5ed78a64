"""One RC-GRPO update on BFCL-shaped groups, prefix-shared (each prompt
forwarded once per micro-batch, ``rcgrpo.model.prefix_sharing``) against dense
(every sequence forwarded whole, ``--model.share_prefixes false``): the
default run's step (``benchmarks.update_step``'s ``rl-groups`` batch: two
training entries, G rollouts each with a reward token drawn per rollout;
G = 2 at quick size, the run's 4 in the full sweep), the 135M model, fp32,
``--fused``, 8,192-token micro-batches, gradient checkpointing on; one fresh
process per side, in this session.

Targets: the shared update's time and peak memory (the update's own, VmHWM
above the loaded model and batch) <= the dense one's (1.0x); both compute
the same loss (checked to 1e-3). Smoke size: two rollouts per entry, prompts
cut to 192 tokens (``benchmarks.update_step``). Cost: quick 1.8 min on 2 idle
cores (tree attention: update 25.4 s shared against 58.8 s dense, 0.43x; peak
3.10 against 3.78 GiB, 0.82x), 6.1 min on cores shared with a test run; smoke
1.6-2.5 min there (at that size the AdamW step and the model load, ~25 s a
side, are most of it).
"""
import pytest

from benchmarks.fresh_process import run_module
from benchmarks.scoreboard import Comparison

RESULTS: dict = {}
VARIANTS = {"shared": "fused", "dense": "fused-dense"}  # update_step's variants
pytestmark = pytest.mark.benchmark(group="update: one RC-GRPO update on BFCL groups (subprocess wall time)")


@pytest.mark.parametrize("side", ["dense", "shared"])
def test_shared_against_dense_update(benchmark, board, side):
    result = benchmark.pedantic(run_module, args=("benchmarks.update_step", VARIANTS[side], "rl-groups"),
                                kwargs=dict(timeout=1800), rounds=1, iterations=1)
    assert result is not None, "the update was stopped by the watchdog (memory or time)"
    RESULTS[side] = result
    benchmark.extra_info.update(result)
    if set(RESULTS) != set(VARIANTS):
        return
    shared, dense = RESULTS["shared"], RESULTS["dense"]
    assert abs(shared["loss"] - dense["loss"]) < 1e-3, (shared["loss"], dense["loss"])
    assert dense["forward_tokens"] == dense["tokens"] > shared["forward_tokens"]
    board.record(Comparison(
        group="update", name="prefix-shared vs dense, RC-GRPO groups",
        ours=f"shared ({shared['forward_tokens']} forwarded, {shared['micro_batches']} micro-batches)",
        peer=f"dense ({dense['forward_tokens']} forwarded, {dense['micro_batches']} micro-batches)",
        ours_s=shared["seconds"], peer_s=dense["seconds"], ours_peak_gib=shared["update_peak_gib"],
        peer_peak_gib=dense["update_peak_gib"], per="update", max_time_ratio=1.0, max_peak_ratio=1.0,
        shape=f"cpu fp32 135M, 2 entries x G={shared['seqs'] // 2}, {shared['tokens']} tokens "
              f"({shared['loss_tokens']} loss), gc-on"))
