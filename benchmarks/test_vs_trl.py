"""rcgrpo vs TRL's GRPOTrainer on the same single-turn work, in one session.

The work (``benchmarks.single_turn``): the first user turn of the training
entries with the shortest prompts, G rollouts each of one reply, scored by
our reward, and one GRPO update per step (loss grpo, beta 0, lr 1e-6, eps
0.2). Same 135M model in fp32, same G, same number of steps on both sides;
each trainer runs in its own fresh process (``benchmarks.rcgrpo_single_turn``,
``benchmarks.trl_single_turn``; its ru_maxrss is the peak) with the same
torch thread count (BENCH_THREADS, default 2). TRL runs one completion per
forward/backward; rcgrpo micro-batches of one prompt group, whose shared
prompt it forwards once (rcgrpo.model.prefix_sharing).

Gradient checkpointing is on for both sides (TRL 1.16's GRPOConfig default);
``--full`` adds the pair with it off for both.

Per step: generation seconds (rcgrpo: weight push + rollouts + rewards; TRL:
``_generate_and_score_completions``, which also pushes weights and scores),
XX
time and peak memory <= TRL's (1.0x); the parts are reported.
"""
import pytest

from benchmarks import scale, single_turn
from benchmarks.fresh_process import child_env, run_module
from benchmarks.scoreboard import Comparison

CHECKPOINTING = scale.pick(smoke=("gc-on",), quick=("gc-on",), full=("gc-on", "gc-off"))
PROGRAMS = {"trl": "benchmarks.trl_single_turn", "rcgrpo": "benchmarks.rcgrpo_single_turn"}
RESULTS: dict = {}
pytestmark = pytest.mark.benchmark(group="RL step: rcgrpo vs TRL GRPOTrainer (subprocess wall time)")


def _summary(result: dict) -> dict:
    steps = result["steps"]
    assert len(steps) == single_turn.STEPS, steps
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in ("generation_s", "update_s", "total_s")}
    return {**mean, "peak_rss_mb": result["peak_rss_mb"], "torch_threads": result["torch_threads"], "steps": steps}


def run_trainer(trainer: str, tmp_path, checkpointing: str) -> dict:
    env = child_env(BENCH_GC="true" if checkpointing == "gc-on" else "false")
    env.setdefault("BENCH_THREADS", "2")
    return _summary(run_module(PROGRAMS[trainer], str(tmp_path), env=env, timeout=3600))


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("trainer", ["trl", "rcgrpo"])
def test_single_turn_steps(benchmark, board, trainer, checkpointing, tmp_path):
    result = benchmark.pedantic(run_trainer, args=(trainer, tmp_path, checkpointing), rounds=1, iterations=1)
    RESULTS[(trainer, checkpointing)] = result
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "steps"})
    benchmark.extra_info["steps"] = result["steps"]
    if trainer != "rcgrpo" or ("trl", checkpointing) not in RESULTS:
        return
    ours, trl = result, RESULTS[("trl", checkpointing)]
    if scale.holds_targets():  # like for like: rcgrpo updated every step, as TRL does
        assert not any(s["update_skipped"] for s in ours["steps"]), ours["steps"]
    shape = (f"cpu fp32 135M, {single_turn.N_PROMPTS} prompts x G{single_turn.G}, <= {single_turn.MAX_NEW} "
             f"new tokens, {checkpointing}")
    for part, name in (("generation_s", "generation + reward"), ("update_s", "update")):
        board.record(Comparison(group="RL step vs TRL", name=f"step: {name}", ours="rcgrpo (vLLM, fused)",
                                peer="TRL GRPOTrainer (HF generate)", ours_s=ours[part], peer_s=trl[part],
                                shape=shape, per="step"))
    board.record(Comparison(group="RL step vs TRL", name="step: total", ours="rcgrpo (vLLM, fused)",
                            peer="TRL GRPOTrainer (HF generate)", ours_s=ours["total_s"], peer_s=trl["total_s"],
                            ours_peak_gib=ours["peak_rss_mb"] / 1024, peer_peak_gib=trl["peak_rss_mb"] / 1024,
                            shape=shape, per="step", max_time_ratio=0.5, max_peak_ratio=1.0))
