"""One RC-GRPO update (forward + backward + optimizer step) of the small
model on a fixed packed batch of real BFCL trajectories
(``benchmarks.update_step``, one fresh process per variant so that no two
share allocator caches):

- fused (chunked fused-linear loss) vs reference (full logits): target, the
  fused update's peak memory <= the reference's (1.0x); time reported.
- prefix-shared vs dense: the fused update with the group's shared prompt
  forwarded once (``rcgrpo.model.prefix_sharing``, the default on sdpa/eager)
  against every sequence forwarded whole; target, time <= 1.0x.

Peak is the update's own: VmHWM above the loaded model and batch. Gradient
checkpointing is on for all three. All three variants compute the same loss
(checked to 1e-3).
"""
import pytest

from benchmarks.fresh_process import run_module
from benchmarks.scoreboard import Comparison

RESULTS: dict = {}
pytestmark = pytest.mark.benchmark(group="update: one RC-GRPO update (subprocess wall time)")


def _row(ours: str, peer: str, name: str, **targets) -> Comparison:
    a, b = RESULTS[ours], RESULTS[peer]
    shape = f"cpu fp32 135M, 1 group x 2 trajectories, {a['tokens']} tokens ({a['loss_tokens']} loss), gc-on"
    return Comparison(group="update", name=name, ours=f"rcgrpo {ours} ({a['forward_tokens']} forwarded)",
                      peer=f"rcgrpo {peer} ({b['forward_tokens']} forwarded)", ours_s=a["seconds"],
                      peer_s=b["seconds"], ours_peak_gib=a["update_peak_gib"], peer_peak_gib=b["update_peak_gib"],
                      shape=shape, per="update", **targets)


@pytest.mark.parametrize("variant", ["reference", "fused-dense", "fused"])
def test_rcgrpo_update(benchmark, board, variant):
    result = benchmark.pedantic(run_module, args=("benchmarks.update_step", variant), kwargs=dict(timeout=1800),
                                rounds=1, iterations=1)
    RESULTS[variant] = result
    benchmark.extra_info.update(result)
    if variant != "fused" or set(RESULTS) != {"reference", "fused-dense", "fused"}:
        return
    for other in ("reference", "fused-dense"):
        assert abs(RESULTS[other]["loss"] - result["loss"]) < 1e-3, (other, RESULTS[other]["loss"], result["loss"])
    board.record(_row("fused", "reference", "fused-linear loss vs full logits", max_peak_ratio=1.0))
    board.record(_row("fused", "fused-dense", "prefix-shared vs dense forward", max_time_ratio=1.0))
