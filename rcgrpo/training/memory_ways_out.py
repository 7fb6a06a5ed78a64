"""The ways out of a memory plan that does not fit: candidate changes to the
run, each as the flags a user would add and the plan re-estimated with them
(`MemoryPlan.replan`). ``rcgrpo.training.memory_plan.check_stage`` lists the
ones that fit, and those that help without fitting alone.

Tried in this order: fewer rollouts (when they are most of the need), LoRA,
more ranks (alone, or with checkpointing and the fused loss), gradient
checkpointing, the fused loss, bfloat16, shorter micro-batches, a smaller
engine share, and the single-process switches together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from rcgrpo.base.host import GiB, gib
from rcgrpo.base.stages import ENGINE_STAGES, RL_STAGES

if TYPE_CHECKING:
    from rcgrpo.training.memory_plan import MemoryPlan

__all__ = ["ways_out", "fewer_rollouts"]

RANK_STEPS = (2, 4, 8, 16, 32, 64, 128)  # the rank counts offered (x the ranks per host on CPU)
GPUS_PER_NODE = 8
SHORTEST_MICRO_BATCH = 1024  # tokens: below this, shorter micro-batches are not offered
# The switches one process can turn on: setting -> (its value, its flag), in
# the order they are offered and combined.
SWITCHES: dict[str, tuple[Any, str]] = {
    "model.lora.enabled": (True, "--model.lora.enabled true"),
    "model.gradient_checkpointing": (True, "--model.gradient_checkpointing true"),
    "run.fused": (True, "--fused"),
    "model.dtype": ("bfloat16", "--model.dtype bfloat16"),
}
Way = tuple[str, "MemoryPlan"]  # (the flags, the plan re-estimated with them)


def ways_out(plan: MemoryPlan) -> list[Way]:
    """Candidate changes, each with its re-estimated plan."""
    out: list[Way] = []
    peak = plan.phases[plan.peak_phase]
    rollouts = next((v for k, v in peak.items() if k.startswith("rollouts held")), 0)
    if rollouts > 0.5 * plan.peak_bytes:  # the rollouts are most of the need: fewer of them first
        out.extend(fewer_rollouts(plan))
    if plan.stage in ENGINE_STAGES:
        return out
    switches = _open_switches(plan)
    if "model.lora.enabled" in switches:
        p = plan.replan({"model.lora.enabled": True}, world_size=1, local_world_size=1)
        out.append(("--model.lora.enabled true" + (" in one process" if plan.world_size > 1 else ""), p))
    out.extend(_more_ranks(plan))
    for key in ("model.gradient_checkpointing", "run.fused", "model.dtype"):
        if key in switches:
            out.append((SWITCHES[key][1], plan.replan({key: switches[key]})))
    out.extend(_shorter_micro_batches(plan))
    out.extend(_smaller_engine_share(plan))
    if len(switches) > 1 and not any(p.fits for f, p in out if not f.startswith("torchrun")):
        out.append(_switches_together(plan, switches))
    return out


def _open_switches(plan: MemoryPlan) -> dict[str, Any]:
    """The SWITCHES this plan's run has not turned on (bfloat16: on CUDA only)."""
    cfg = plan.cfg
    off = {
        "model.lora.enabled": not cfg.model.lora.enabled,
        "model.gradient_checkpointing": not cfg.model.gradient_checkpointing,
        "run.fused": not cfg.run.fused,
        "model.dtype": plan.device_type == "cuda" and cfg.model.dtype == "float32",
    }
    return {key: value for key, (value, _) in SWITCHES.items() if off[key]}


def _switches_together(plan: MemoryPlan, switches: dict[str, Any]) -> Way:
    """Every open switch at once, for when none fits alone."""
    one = "model.lora.enabled" in switches  # LoRA is single-process only
    combo = " ".join(SWITCHES[k][1] for k in switches) + " together"
    if one and plan.world_size > 1:
        combo += " in one process"
    return combo, plan.replan(switches, world_size=1 if one else None, local_world_size=1 if one else None)


def fewer_rollouts(plan: MemoryPlan) -> list[Way]:
    """The largest group size, and the largest batch, that fit (halving), when
    the rollouts held are what does not fit."""
    g = plan.cfg.grpo
    if plan.stage in RL_STAGES:
        settings = [("grpo.group_size", g.group_size, 2), ("grpo.batch_size", g.batch_size, max(1, g.mini_batches))]
    elif plan.stage == "rctp-data" and plan.rctp_entries:
        settings = [("rctp.failure_attempts", plan.cfg.rctp.failure_attempts, 1)]
    else:
        return []
    out = []
    for key, value, low in settings:
        n = value // 2
        while n >= low:
            p = plan.replan({key: n})
            if p.fits:
                out.append((f"--{key} {n}", p))
                break
            n //= 2
    return out


def _ranks_flag(plan: MemoryPlan, n: int) -> tuple[str, int]:
    """(torchrun command, local world size) for n ranks."""
    if plan.device_type == "cpu":
        # Ranks of one host share its memory: only more hosts help.
        local = plan.local_world_size
        return f"torchrun --nnodes {n // local} --nproc_per_node {local}", local
    if n <= GPUS_PER_NODE:
        return f"torchrun --nproc_per_node {n}", n
    return f"torchrun --nnodes {n // GPUS_PER_NODE} --nproc_per_node {GPUS_PER_NODE}", GPUS_PER_NODE


def _more_ranks(plan: MemoryPlan) -> list[Way]:
    """The fewest ranks that fit (full fine-tuning: LoRA is single-process
    only), alone, or, when checkpointing and the fused loss do not fit alone,
    with them; nothing when no count fits."""
    cfg = plan.cfg
    extra: dict[str, Any] = {}
    extra_flags = []
    if not cfg.model.gradient_checkpointing:
        extra["model.gradient_checkpointing"] = True
        extra_flags.append("--model.gradient_checkpointing true")
    if not cfg.run.fused:
        extra["run.fused"] = True
        extra_flags.append("--fused")
    tries = [({}, [])] + ([(extra, extra_flags)] if extra and not plan.replan(extra).fits else [])
    for changes, flags in tries:
        found = _fewest_ranks(plan, changes, flags)
        if found:
            return [found]
    return []


def _fewest_ranks(plan: MemoryPlan, changes: dict[str, Any], flags: list[str]) -> Optional[Way]:
    step = plan.local_world_size if plan.device_type == "cpu" else 1
    for n in (n * step for n in RANK_STEPS):
        if n <= plan.world_size:
            continue
        flag, local = _ranks_flag(plan, n)
        p = plan.replan({"model.lora.enabled": False, **changes}, world_size=n, local_world_size=local)
        if p.fits:
            return (" ".join([flag, *flags]) + (" with --model.lora.enabled false" if plan.cfg.model.lora.enabled
                                                else "") + f" (~{gib(p.need_bytes)} GiB per rank)", p)
    return None


def _shorter_micro_batches(plan: MemoryPlan) -> list[Way]:
    """The longest micro-batch (halving) that fits; when none does, the
    shortest tried, if activations are the biggest item of the update. An
    RL stage's trajectories get shorter with it once below their length."""
    cfg = plan.cfg
    update = plan.phases.get("update", {})
    acts_lead = bool(update) and max(update, key=update.get).startswith(("activations", "logits", "loss"))
    best = None
    t = plan.micro_batch_tokens // 2
    while t >= SHORTEST_MICRO_BATCH:
        if plan.stage in RL_STAGES and t < cfg.grpo.max_total_tokens:
            if t <= cfg.data.max_prompt_tokens:
                break  # a trajectory must hold its prompt
            changes = {"grpo.max_total_tokens": t, "run.micro_batch_tokens": t}
            flag = f"--grpo.max_total_tokens {t} --run.micro_batch_tokens {t} (shorter trajectories)"
        else:
            changes = {"run.micro_batch_tokens": t}
            flag = f"--run.micro_batch_tokens {t}"
        best = (flag, plan.replan(changes))
        if best[1].fits:
            break
        t //= 2
    return [best] if best is not None and (best[1].fits or acts_lead) else []


def _smaller_engine_share(plan: MemoryPlan) -> list[Way]:
    """The largest vLLM share of the GPU (in 5% steps) that fits, when the
    rollout phase is the peak, and the engine keeps its weights and some KV
    cache."""
    cfg = plan.cfg
    if not (plan.device_type == "cuda" and cfg.run.engine != "hf" and "rollout" in plan.phases
            and plan.peak_phase == "rollout"):
        return []
    engine_floor = plan.compute_bytes * plan.shape.params / max(1, cfg.run.engine_tp_size) + GiB
    f = round(cfg.run.engine_memory_fraction - 0.05, 2)
    while f >= 0.05 and f * plan.device_bytes >= engine_floor:
        p = plan.replan({"run.engine_memory_fraction": f})
        if p.fits:
            return [(f"--run.engine_memory_fraction {f:.2f}", p)]
        f = round(f - 0.05, 2)
    return []
