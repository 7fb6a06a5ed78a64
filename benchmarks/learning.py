"""Does it learn? The pipeline on CPU with the small model, measured.

    python benchmarks/learning.py                   # every part (~7 h on 2 cores); resumable
    python benchmarks/learning.py --parts rctp,gap  # section 2 only: do the reward tokens take hold?
    python benchmarks/learning.py --report-only     # rewrite the report from finished parts

Every part runs in its own subprocess, through `python -m rcgrpo.train` (the
real trainer, the real vLLM CPU engine, the real BFCL checker) or through a
worker of this script; re-running skips finished parts, and a trainer killed
by a signal is resumed from its last checkpoint. Settings are spelled out
here (`--preset none`), so that a change of the presets does not change the
study. The parts, in order:

1. rctp: RCTP on the study's entries (8 short `base` training entries that
   share one system prompt), one run per failure source: near misses (the
   expert with one call dropped or one argument changed, labelled by
   executing) and, as the control, real rollouts of the starting model (the
   paper's source; no near misses mixed in). 30 full-batch steps at lr 1e-4.
   The steer at each pair's first divergent token is logged every step.
   `late_divergence` is only built (no training): how many of the starting
   model's rollouts part from the expert late enough.
2. gap: each RCTP checkpoint sampled on its training entries under
   <|high_reward|> and under <|low_reward|> (T = 1): rewards with 95%
   Wilson intervals and the gap's 95% interval (Newcombe).
   The RL arms start from the control run's checkpoint (`--rl-start-source`
   rollouts, the paper's failure source) at step `--rl-start-step` (15): at
   step 30 the policy already solves ~98% of its rollouts under the high
   token, which leaves RL no room to show (its gap is measured at both).
3. sft: the SFT start of the SFT arms: the experts alone, `--sft-steps` (8)
   full-batch steps at lr 1e-4 (the paper's SFT : RCTP epochs are 2 : 5).
4. sweep: short RC-GRPO runs from the RCTP start at a few learning rates;
   the one whose sampled reward under the high token is highest after the
   sweep's steps (the lower lr on a tie) is used by every arm.
5. arms: SFT + GRPO, RCTP + GRPO, RCTP + RC-GRPO and SFT + GRPO with dynamic
   sampling, `--steps` RL steps each (batch 2 x G 5, beta 0.1, eps 0.2, T 1),
   with the trainer's sampled-reward probe on a fixed sample of the training
   prompts (64 rollouts per token) at the start, every 10 steps and at the end.

It writes runs/learning/learning.{json,md} and its plots. Results are what
was measured; nothing here expects a direction.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Eight short `base` training entries with the same API class (TradingBot), so
# that every record shares one ~1.9k-token system prompt (forwarded once per
# micro-batch), with 2-4 turns and replies of at most 49 tokens. The first
# four are the earlier pilots' entries.
ENTRIES = ["multi_turn_base_100", "multi_turn_base_104", "multi_turn_base_105", "multi_turn_base_132",
           "multi_turn_base_115", "multi_turn_base_120", "multi_turn_base_135", "multi_turn_base_146"]
SOURCES = ("near_miss", "rollouts")  # trained and compared; late_divergence is only built
# arm -> (its pipeline's start: "sft" or "rctp", the RL stage)
# (in the order they run: the paper's arm first)
ARMS = {"rctp+rc-grpo": ("rctp", "rc-grpo"), "rctp+grpo": ("rctp", "grpo"), "sft+grpo": ("sft", "grpo"),
        "sft+grpo-ds": ("sft", "grpo")}
PARTS = ("rctp", "gap", "sft", "sweep", "arms")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/learning"), help="parent folder of every part")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts to run, of {PARTS}")
    p.add_argument("--entries", default=",".join(ENTRIES), help="comma-separated training entry ids")
    p.add_argument("--rctp-steps", type=int, default=30, help="RCTP full-batch steps (epochs)")
    p.add_argument("--rctp-lr", type=float, default=1e-4)
    p.add_argument("--rl-start-source", choices=SOURCES, default="rollouts",
                   help="the RCTP run (its failure source) whose checkpoint the RCTP arms start from")
    p.add_argument("--rl-start-step", type=int, default=15,
                   help="the RCTP arms start from that run's checkpoint of this step (a multiple of 5)")
    p.add_argument("--sft-steps", type=int, default=8, help="SFT full-batch steps (epochs)")
    p.add_argument("--gap-rollouts", type=int, default=96, help="rollouts per reward token in part 2")
    p.add_argument("--sweep-lrs", default="5e-6,1.5e-5,4.5e-5", help="RL learning rates of the sweep")
    p.add_argument("--sweep-steps", type=int, default=6)
    p.add_argument("--steps", type=int, default=30, help="RL steps per arm")
    p.add_argument("--eval-every", type=int, default=10, help="RL steps between sampled-reward probes")
    p.add_argument("--eval-rollouts", type=int, default=64, help="rollouts per probe and reward token")
    p.add_argument("--batch-size", type=int, default=2, help="prompts per RL step")
    p.add_argument("--group-size", type=int, default=5, help="rollouts per prompt (G)")
    p.add_argument("--ds-max-draws", type=int, default=3, help="dynamic sampling: rollout rounds per step at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-only", action="store_true", help="only re-read finished parts and rewrite the report")
    p.add_argument("--worker", choices=["gap"], help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--probe-seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--conditionings", default="high,low", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def faulty_probe_steps(rows: list[dict]) -> list[int]:
    """Steps whose probe an engine fault may have played: the next step's
    rollouts, played by the engine holding the same weights, came back with
    non-finite log-probs (their agreement with the trainer is NaN). Runs
    since engine faults are replayed (rcgrpo.rollout.engine.EngineFault)
    have none."""
    faults = set(engine_fault_steps(rows))
    return [r["step"] for r in rows if r["step"] + 1 in faults and any(k.startswith("sampled_reward_") for k in r)]


def engine_fault_steps(rows: list[dict]) -> list[int]:
    """Steps whose rollouts came back with non-finite log-probs (their
    agreement with the trainer is NaN)."""
    return [r["step"] for r in rows if not math.isfinite(r.get("logp_diff_abs_mean", 0.0))]


def remeasured_probe(args, run: Path, step: int) -> Path:
    """Where the re-measure of a run's probe at `step` is kept."""
    return args.out / "parts" / f"probe-{run.name}-step{step}.json"


def remeasure_part(args, run: Path, stage: str, step: int, conditionings: list[str]) -> Path:
    """A suspect probe measured again from the run's checkpoint of that step,
    in a fresh engine, with the trainer's probe seed (the step-0 probe of the
    paper's arm, 27/64 and 7/64, re-measured from its start model gave 27/64
    and 7/64)."""
    from rcgrpo.training.reward_probe import probe_seed

    result = remeasured_probe(args, run, step)
    if not result.exists():
        sh([sys.executable, __file__, "--worker", "gap", "--result", result, "--entries", args.entries,
            "--gap-rollouts", args.eval_rollouts, "--seed", args.seed, "--probe-seed", probe_seed(args.seed),
            "--conditionings", ",".join(conditionings),
            "--model", run / "checkpoints" / stage / f"ckpt-{step:08d}" / "model"],
           args.out / "logs" / f"{result.stem}.txt")
    return result


# ------------------------------------------------------------------ running parts


def sh(cmd: list, log: Path, retries: int = 2) -> None:
    """One subprocess, its output appended to `log` (its progress lines also
    to ours). A process killed by a signal (the OOM killer on a shared
    machine) is started again up to `retries` times, a trainer with
    --resume; any other failure stops the study."""
    cmd = [str(c) for c in cmd]
    print("$", " ".join(cmd), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, RCGRPO_PROGRESS="0"))
        for line in proc.stdout:
            f.write(line)
            if line.startswith(("[", "rcgrpo", "run folder")) and "|" not in line:
                sys.stdout.write(line)
                sys.stdout.flush()
    if proc.wait() < 0 and retries > 0:
        print(f"killed by signal {-proc.returncode}: starting again", flush=True)
        if "rcgrpo.train" in cmd and "--resume" not in cmd:
            cmd.append("--resume")
        return sh(cmd, log, retries - 1)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed (exit {proc.returncode}); its log: {log}")


def common_flags(args) -> list:
    """What every trainer run of the study shares."""
    return ["--preset", "none", "--fused", "--out-dir", args.out, "--data.categories", "base",
            "--data.entry_ids", args.entries, "--data.seed", args.seed, "--data.doc_style", "compact_no_response",
            "--data.max_prompt_tokens", 2600, "--grpo.max_new_tokens", 96, "--grpo.max_total_tokens", 4096,
            "--grpo.temperature", 1.0, "--rctp.failure_temperature", 1.0, "--run.micro_batch_tokens", 8192,
            # every checkpoint kept: the RL arms start from one of RCTP's
            "--run.checkpoint_every", 5, "--run.keep_last", 6, "--run.report_to", "tensorboard"]


def done(args, name: str, stage: str) -> bool:
    return (args.out / name / "stages" / f"{stage}.done").exists()


def train(args, name: str, stage: str, flags: list) -> Path:
    """A trainer run of the study (continued when a killed study left it)."""
    if not done(args, name, stage):
        resume = ["--resume"] if (args.out / name / "config.json").exists() else []
        sh([sys.executable, "-m", "rcgrpo.train", *common_flags(args), "--name", name, *resume, *flags],
           args.out / "logs" / f"{name}.txt")
    return args.out / name


def rctp_part(args, source: str) -> Path:
    rollouts = ["--rctp.failure_attempts", 4, "--rctp.fill_with_perturbed", "false"] if source != "near_miss" else []
    n = len(args.entries.split(","))
    return train(args, f"rctp-{source}", "rctp", [
        "--pipeline", "rctp+rc-grpo", "--stages", "rctp-data,rctp", "--rctp.failure_source", source, *rollouts,
        "--rctp.lr", args.rctp_lr, "--rctp.batch_size", 2 * n, "--rctp.epochs", args.rctp_steps,
        "--rctp.warmup_ratio", 0, "--rctp.steer_every", 1])


def rl_start(args, rctp_run: Path, materialise: bool = True) -> Path:
    """The RCTP arms' start: an RCTP run's model at `--rl-start-step`,
    copied out of its checkpoint (a model folder with its tokenizer) into
    `<run>/start-step<N>/models/rctp`; the run's final model when that step
    is its last. `materialise=False` only names the folder (reading
    finished parts needs no checkpoint)."""
    import shutil

    if args.rl_start_step == args.rctp_steps:
        return rctp_run
    start = rctp_run / f"start-step{args.rl_start_step}"
    if materialise and not (start / "models" / "rctp" / "model.safetensors").exists():
        ckpt = rctp_run / "checkpoints" / "rctp" / f"ckpt-{args.rl_start_step:08d}" / "model"
        if not ckpt.is_dir():
            # Checkpoints are not committed: a fresh clone has the results, not the weights.
            raise SystemExit(f"--rl-start-step {args.rl_start_step}: no checkpoint {ckpt}; to rebuild it, "
                             f"move {rctp_run} aside and run --parts rctp again")
        shutil.copytree(ckpt, start / "models" / "rctp", dirs_exist_ok=True)
    return start


def late_divergence_part(args) -> Path:
    return train(args, "data-late_divergence", "rctp-data", [
        "--pipeline", "rctp+rc-grpo", "--stages", "rctp-data", "--rctp.failure_source", "late_divergence",
        "--rctp.failure_attempts", 16, "--rctp.fill_with_perturbed", "false"])


def sft_part(args) -> Path:
    n = len(args.entries.split(","))
    return train(args, "sft", "sft", ["--pipeline", "sft+grpo", "--stages", "sft", "--sft.lr", args.rctp_lr,
                                      "--sft.batch_size", n, "--sft.epochs", args.sft_steps, "--sft.warmup_ratio", 0])


def rl_flags(args, arm: str, start: Path, lr: float, steps: int, eval_every: int) -> list:
    stage = ARMS[arm][1]
    ds = ["--grpo.dynamic_sampling_max_draws", args.ds_max_draws] if arm.endswith("-ds") else []
    return ["--pipeline", arm, "--stages", stage, "--model", start / "models" / ARMS[arm][0],
            "--grpo.steps", steps, "--grpo.batch_size", args.batch_size, "--grpo.group_size", args.group_size,
            "--grpo.lr", lr, "--grpo.beta", 0.1, "--grpo.eval_every", eval_every,
            "--grpo.eval_rollouts", args.eval_rollouts, *ds]


def worker_gap(args) -> dict:
    """The RCTP checkpoint's sampled reward on the study's entries under each
    reward token: the same prompts and seeds under both."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rcgrpo.envs.bfcl import load_entries, split_train_test
    from rcgrpo.evaluation.rollouts import named_entries
    from rcgrpo.evaluation.sampled_reward import sampled_reward
    from rcgrpo.model.loading import load_tokenizer
    from rcgrpo.rollout import make_engine
    from rcgrpo.rollout.agent_loop import RolloutConfig

    train_split, _ = split_train_test(load_entries(["base"]))
    entries = named_entries(train_split, args.entries.split(","), "--entries", "training entries of base")
    engine = make_engine("auto", args.model, dtype="float32", max_model_len=4096, seed=args.seed)
    seed = args.seed + 11 if args.probe_seed is None else args.probe_seed
    config = RolloutConfig(max_new_tokens=96, max_total_tokens=4096, temperature=1.0, seed=seed,
                           doc_style="compact_no_response")
    t0 = time.time()
    rates = {c: sampled_reward(engine, load_tokenizer(args.model), entries, c, args.gap_rollouts, config)
             for c in args.conditionings.split(",")}
    return {"model": str(args.model), "seconds": round(time.time() - t0, 1),
            **{c: {"k": r.k, "n": r.n} for c, r in rates.items()}}


def gap_part(args, rctp_run: Path) -> dict:
    result = args.out / "parts" / f"gap-{rctp_run.relative_to(args.out).as_posix().replace('/', '-')}.json"
    if not result.exists():
        sh([sys.executable, __file__, "--worker", "gap", "--result", result, "--entries", args.entries,
            "--gap-rollouts", args.gap_rollouts, "--seed", args.seed, "--model", rctp_run / "models" / "rctp"],
           args.out / "logs" / f"{result.stem}.txt")
    return json.loads(result.read_text())


# ------------------------------------------------------------------ reading parts


def records(run: Path, stage: str) -> list[dict]:
    from rcgrpo.run.metrics import read_records

    path = run / "metrics.jsonl"
    return [r for r in read_records(path)[0] if r.get("stage") == stage] if path.exists() else []


def probes(rows: list[dict], name: str) -> list[dict]:
    """The sampled-reward probes of an RL run under `name` (high, low, none)."""
    key = f"sampled_reward_{name}"
    return [{"step": r["step"], "mean": r[key], "ci": [r[key + "_lo"], r[key + "_hi"]], "n": r[key + "_n"]}
            for r in rows if key in r]


def sweep_choice(sweep: dict) -> float | None:
    """The sweep's learning rate: the highest final sampled reward under the
    high token, the lower lr on a tie; None before the sweep is done."""
    finals = {float(lr): p[-1]["mean"] for lr, p in sweep.items() if p}
    if not finals:
        return None
    return min(finals, key=lambda lr: (-finals[lr], lr))


def summarise_arm(rows: list[dict], conditioning: str, remeasured: dict[int, dict] | None = None) -> dict:
    """An RL arm's per-step series and its training-dynamics numbers.
    `remeasured` ({step: a re-measure part's result}) replaces the probes an
    engine fault played; those steps are listed under "remeasured", and the
    steps whose rollouts the fault played under "engine_fault"."""
    from rcgrpo.evaluation.stats import Rate

    keys = ("reward_mean", "reward_mean_high", "reward_mean_low", "zero_var_frac", "entropy", "kl", "clip_frac",
            "rollouts_played", "adv_abs_mean", "update_skipped", "rollout_s", "update_s", "grad_norm",
            "engine_replays", "probe_engine_replays")
    steps = [{k: r[k] for k in ("step", *keys) if k in r} for r in rows if r["step"] > 0 and "reward_mean" in r]
    mean = lambda k: (sum(s[k] for s in steps if k in s) / max(1, sum(k in s for s in steps)))  # noqa: E731
    curves = {c: probes(rows, c) for c in ("high", "low", "none") if probes(rows, c)}
    for step, part in (remeasured or {}).items():
        for c, ps in curves.items():
            for p in ps:
                if p["step"] == step and c in part:
                    r = Rate(part[c]["k"], part[c]["n"])
                    p.update(mean=r.mean, ci=list(r.ci), n=r.n, played_by_fault=p["mean"])
    return {"steps": steps, "probes": curves, "remeasured": sorted(remeasured or {}),
            "engine_fault": engine_fault_steps(rows),
            "conditioning": conditioning, "zero_var_mean": mean("zero_var_frac"), "entropy_mean": mean("entropy"),
            "rollouts_played": sum(s.get("rollouts_played", 0) for s in steps),
            "seconds": sum(s.get("rollout_s", 0) + s.get("update_s", 0) for s in steps)}


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean and its normal 95% interval over steps (the steps are treated as
    independent draws, which consecutive RL steps are not quite)."""
    import statistics

    from rcgrpo.evaluation.stats import Z95

    m = statistics.fmean(values)
    half = Z95 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return m, m - half, m + half


def dynamics(arms: dict, groups_per_step: int, late: int = 10) -> dict | None:
    """The paper's training-dynamics claims, RCTP + RC-GRPO against RCTP +
    GRPO (the same start, the same lr): (1) a lower zero-variance share of
    groups (pooled group counts, late = the last `late` steps), so a non-zero
    advantage spread late in training; (2) its reward reached at lower policy
    entropy (the final probe under the high token; entropy over the last
    `late` steps), entropy and reward negatively correlated over the steps.
    None until both arms have steps."""
    from rcgrpo.evaluation.stats import Rate, difference

    rc, plain = arms.get("rctp+rc-grpo"), arms.get("rctp+grpo")
    if not (rc and plain and rc["steps"] and plain["steps"]):
        return None
    out = {"late_steps": late}
    zero = lambda rows: Rate(sum(round(x["zero_var_frac"] * groups_per_step) for x in rows),  # noqa: E731
                             groups_per_step * len(rows))
    for arm, a in (("rc-grpo", rc), ("grpo", plain)):
        st = a["steps"]
        ent = [x["entropy"] for x in st[-late:]]
        pairs = [(x["entropy"], x["reward_mean"]) for x in st]
        final = a["probes"].get("high", [])
        out[arm] = {"steps": len(st), "zero_var": zero(st), "zero_var_late": zero(st[-late:]),
                    "adv_abs_late": sum(x.get("adv_abs_mean", 0.0) for x in st[-late:]) / len(st[-late:]),
                    "entropy_late": mean_ci(ent), "entropy_reward_corr": pearson(pairs),
                    "final_reward": final[-1] if final else None}
    d, ci = difference(out["rc-grpo"]["zero_var"], out["grpo"]["zero_var"])
    dl, cil = difference(out["rc-grpo"]["zero_var_late"], out["grpo"]["zero_var_late"])
    out["zero_var_diff"], out["zero_var_late_diff"] = (d, ci), (dl, cil)
    out["claim_zero_var"] = verdict(ci)
    e_rc, e_g = out["rc-grpo"]["entropy_late"], out["grpo"]["entropy_late"]
    f_rc, f_g = out["rc-grpo"]["final_reward"], out["grpo"]["final_reward"]
    lower_entropy = "lower" if e_rc[2] < e_g[1] else "higher" if e_rc[1] > e_g[2] else "overlapping"
    reward = ("higher" if f_rc["ci"][0] > f_g["ci"][1] else "lower" if f_rc["ci"][1] < f_g["ci"][0]
              else "overlapping") if f_rc and f_g else "unmeasured"
    out["claim_entropy"] = {"entropy": lower_entropy, "reward": reward}
    for arm in ("rc-grpo", "grpo"):
        for key in ("zero_var", "zero_var_late"):
            r = out[arm][key]
            out[arm][key] = {"k": r.k, "n": r.n, "mean": r.mean, "ci": list(r.ci)}
    return out


def verdict(ci: tuple[float, float]) -> str:
    """Whether a difference's 95% interval says RC-GRPO's value is lower."""
    return "lower" if ci[1] < 0 else "higher" if ci[0] > 0 else "not distinguishable"


def pearson(pairs: list[tuple[float, float]]) -> float | None:
    """Pearson's r over the steps; None where it is undefined (under 3 steps, a constant series)."""
    import statistics

    try:
        return statistics.correlation(*zip(*pairs)) if len(pairs) >= 3 else None
    except statistics.StatisticsError:
        return None


# --------------------------------------------------------------------- report


def fmt_rate(p: dict) -> str:
    return f"{p['mean']:.3f} [{p['ci'][0]:.2f}, {p['ci'][1]:.2f}]"


def report(results: dict) -> str:
    from rcgrpo.evaluation.stats import Rate, difference

    s = results["settings"]
    lines = [f"Entries ({len(s['entries'].split(','))}): {s['entries']}. SmolLM2-135M-Instruct, full fine-tuning, "
             "fp32, 2-core CPU; sampling T = 1, at most 96 new tokens per reply.", ""]
    rctp = results.get("rctp", {})
    if rctp:
        lines += [f"## Do the reward tokens take hold? (RCTP, {s['rctp_steps']} full-batch steps at lr "
                  f"{s['rctp_lr']})", "",
                  "| failure source | records | first divergence (tokens into the reply: min / median / max) | "
                  "steer at step 0 | at the end | p(expert) high / low at the end | "
                  "sampled reward, high | low | high - low (95%) | training minutes |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for source, part in rctp.items():
            st = part.get("steer", [])
            g = part.get("gap")
            div = part.get("data", {}).get("first_divergence_tokens")
            cells = [source, str(part.get("data", {}).get("total", "-")),
                     " / ".join(map(str, div)) if div else "-",
                     f"{st[0]['steer']:+.3f}" if st else "-", f"{st[-1]['steer']:+.3f}" if st else "-",
                     f"{st[-1]['p_expert_high']:.3f} / {st[-1]['p_expert_low']:.3f}" if st else "-"]
            if g:
                hi, lo = Rate(g["high"]["k"], g["high"]["n"]), Rate(g["low"]["k"], g["low"]["n"])
                d, (a, b) = difference(hi, lo)
                cells += [str(hi), str(lo), f"{d:+.3f} [{a:+.3f}, {b:+.3f}]"]
            else:
                cells += ["-", "-", "-"]
            cells.append(f"{part['minutes']:.0f}" if part.get("minutes") is not None else "-")
            lines.append("| " + " | ".join(cells) + " |")
        start = results.get("rl_start", {})
        if start.get("gap"):
            g = start["gap"]
            hi, lo = Rate(g["high"]["k"], g["high"]["n"]), Rate(g["low"]["k"], g["low"]["n"])
            d, (a, b) = difference(hi, lo)
            lines += ["", f"The RL arms' start, the {start['source']} run at step {start['step']}: high {hi}, "
                      f"low {lo}, high - low {d:+.3f} [{a:+.3f}, {b:+.3f}]."]
        late = results.get("late_divergence")
        if late:
            lines += ["", f"late_divergence (data only; 16 rollouts per entry, first divergence at least 8 "
                      f"generated tokens in): {late.get('failure_low', 0)} of {late.get('expert_high', 0)} "
                      "entries yielded such a failure."]
        lines.append("")
    sweep = results.get("sweep", {})
    if any(sweep.values()):
        lines += [f"## Learning rate sweep (RCTP + RC-GRPO from the RL arms' start, {s['sweep_steps']} steps)", "",
                  "| lr | sampled reward under high, step 0 | after the sweep |", "|---|---|---|"]
        for lr, p in sweep.items():
            if p:
                lines.append(f"| {lr} | {fmt_rate(p[0])} | {fmt_rate(p[-1])} |")
        lines += ["", f"Chosen: lr {results.get('lr')}.", ""]
    arms = results.get("arms", {})
    if arms:
        lines += [f"## Learning curves ({s['steps']} RL steps per arm, batch {s['batch_size']} x G "
                  f"{s['group_size']}, lr {results.get('lr')}, beta 0.1)", "",
                  "Sampled reward on a fixed sample of the training prompts (95% Wilson intervals; under the high "
                  "token for the RCTP arms, without a token for the SFT arms):", ""]
        points = sorted({p["step"] for a in arms.values() for ps in a["probes"].values() for p in ps})
        lines += ["| arm | " + " | ".join(f"step {x}" for x in points) + " | change (95%) |",
                  "|---|" + "---|" * (len(points) + 1)]
        for arm, a in arms.items():
            ps = {p["step"]: p for p in a["probes"].get(a["conditioning"], [])}
            change = "-"
            if len(ps) > 1:
                first, last = ps[min(ps)], ps[max(ps)]
                k = lambda p: Rate(round(p["mean"] * p["n"]), p["n"])  # noqa: E731
                d, (lo, hi) = difference(k(last), k(first))
                change = f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            lines.append(f"| {arm} | " + " | ".join(fmt_rate(ps[x]) + (" ‡" if "played_by_fault" in ps[x] else "")
                                                     if x in ps else "-" for x in points) + f" | {change} |")
        for arm, a in arms.items():
            for cond, ps in a["probes"].items():
                for p in ps:
                    if "played_by_fault" in p:
                        lines += ["", f"‡ {arm}, step {p['step']} ({cond}): re-measured from the run's step-"
                                  f"{p['step']} checkpoint in a fresh engine with the probe's seed. The trainer's "
                                  f"probe there read {p['played_by_fault']:.3f}, played by a faulty engine: the "
                                  "next step's rollouts, on the same weights, came back with NaN log-probs."]
        lines += ["", "Training dynamics (means over the steps; per-step rewards are the steps' own rollouts):", "",
                  "| arm | zero-variance share | entropy | KL at the end | clip fraction | rollouts played | "
                  "reward high / low (RC-GRPO: high - low) | minutes |", "|---|---|---|---|---|---|---|---|"]
        for arm, a in arms.items():
            st = a["steps"]
            if not st:
                continue
            hl = "-"
            if any("reward_mean_low" in x for x in st):
                h = [x["reward_mean_high"] for x in st if "reward_mean_high" in x]
                lo = [x["reward_mean_low"] for x in st if "reward_mean_low" in x]
                hl = f"{sum(h) / len(h):.3f} / {sum(lo) / len(lo):.3f} ({sum(h) / len(h) - sum(lo) / len(lo):+.3f})"
            clip = [x.get("clip_frac", 0.0) for x in st]
            lines.append(f"| {arm} | {a['zero_var_mean']:.2f} | {a['entropy_mean']:.3f} | "
                         f"{st[-1].get('kl', 0.0):.2e} | {sum(clip) / len(clip):.3f} | {a['rollouts_played']} | "
                         f"{hl} | {a['seconds'] / 60:.0f} |")
        lines.append("")
    if arms:
        lines += per_step_report(arms)
    dyn = results.get("dynamics")
    if dyn:
        lines += dynamics_report(dyn)
    if results.get("minutes") is not None:
        lines.append(f"Wall time of the parts run by the last invocation: {results['minutes']} min.")
    return "\n".join(lines) + "\n"


def per_step_report(arms: dict) -> list[str]:
    """Every RL step of every arm: what the step's own rollouts earned and
    what the update did."""
    lines = ["## Per step", "", "Reward columns are the step's own rollouts (batch x G, under the token each was "
             "conditioned on); KL is k3 per loss token; rollouts played counts dynamic sampling's redraws.", ""]
    cell = lambda x, k, f: format(x[k], f) if k in x else "-"  # noqa: E731
    for arm, a in arms.items():
        lines += [f"<details><summary>{arm}</summary>", "",
                  "| step | reward | high | low | high - low | zero-variance share | entropy | KL | clip fraction | "
                  "rollouts played | skipped |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in a["steps"]:
            gap = (f"{x['reward_mean_high'] - x['reward_mean_low']:+.2f}"
                   if "reward_mean_high" in x and "reward_mean_low" in x else "-")
            lines.append(f"| {x['step']} | {cell(x, 'reward_mean', '.2f')} | {cell(x, 'reward_mean_high', '.2f')} | "
                         f"{cell(x, 'reward_mean_low', '.2f')} | {gap} | {cell(x, 'zero_var_frac', '.2f')} | "
                         f"{cell(x, 'entropy', '.3f')} | {cell(x, 'kl', '.2e')} | {cell(x, 'clip_frac', '.3f')} | "
                         f"{cell(x, 'rollouts_played', 'd')} | {cell(x, 'update_skipped', 'd')} |")
            if x["step"] in a.get("engine_fault", ()):  # mark the step's own cell
                lines[-1] = lines[-1].replace(f"| {x['step']} |", f"| {x['step']} (engine fault: NaN log-probs) |", 1)
        lines += ["", "</details>", ""]
    return lines


def dynamics_report(dyn: dict) -> list[str]:
    rc, g = dyn["rc-grpo"], dyn["grpo"]
    share = lambda r: f"{r['k']}/{r['n']} = {r['mean']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}]"  # noqa: E731
    diff = lambda d: f"{d[0]:+.2f} [{d[1][0]:+.2f}, {d[1][1]:+.2f}]"  # noqa: E731
    ent = lambda e: f"{e[0]:.3f} [{e[1]:.3f}, {e[2]:.3f}]"  # noqa: E731
    corr = lambda r: "-" if r is None else f"{r:+.2f}"  # noqa: E731
    late = dyn["late_steps"]
    lines = [f"## The paper's training-dynamics claims (RCTP + RC-GRPO vs RCTP + GRPO, {rc['steps']} and "
             f"{g['steps']} steps)", "",
             "| | RCTP + RC-GRPO | RCTP + GRPO | RC-GRPO - GRPO (95%) |", "|---|---|---|---|",
             f"| zero-variance groups, all steps | {share(rc['zero_var'])} | {share(g['zero_var'])} | "
             f"{diff(dyn['zero_var_diff'])} |",
             f"| zero-variance groups, last {late} steps | {share(rc['zero_var_late'])} | "
             f"{share(g['zero_var_late'])} | {diff(dyn['zero_var_late_diff'])} |",
             f"| mean abs advantage, last {late} steps | {rc['adv_abs_late']:.3f} | {g['adv_abs_late']:.3f} | |",
             f"| entropy, last {late} steps (mean over steps, 95%) | {ent(rc['entropy_late'])} | "
             f"{ent(g['entropy_late'])} | |",
             "| final sampled reward under the high token | "
             + " | ".join(fmt_rate(a["final_reward"]) if a["final_reward"] else "-" for a in (rc, g)) + " | |",
             f"| Pearson r of entropy and reward over the steps | {corr(rc['entropy_reward_corr'])} | "
             f"{corr(g['entropy_reward_corr'])} | |", "",
             f"1. A lower zero-variance share for RC-GRPO: its share over all steps is "
             f"{dyn['claim_zero_var']} (Newcombe interval of the pooled group counts; groups of one run are "
             "not independent draws, so the interval is optimistic).",
             f"2. Its reward at lower entropy: entropy over the last {late} steps {dyn['claim_entropy']['entropy']}"
             f", final sampled reward {dyn['claim_entropy']['reward']} (non-overlapping 95% intervals count; "
             "anything else is 'overlapping').", ""]
    return lines


def running_mean(values: list[float], window: int = 5) -> list[float]:
    """The mean of each value and the up to `window - 1` before it."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    arms = results.get("arms", {})
    ax = axes[0][0]
    for source, part in results.get("rctp", {}).items():
        st = part.get("steer", [])
        ax.plot([x["step"] for x in st], [x["steer"] for x in st], marker="o", markersize=3, label=source)
    ax.set(title="RCTP: steer at the first divergent token", xlabel="RCTP step",
           ylabel="log p(expert | high) - log p(expert | low) (nats)")
    ax.axhline(0, color="k", lw=0.5)
    ax.legend(fontsize=8)
    ax = axes[0][1]
    for arm, a in arms.items():
        for cond, ps in a["probes"].items():
            if not ps:
                continue
            line, = ax.plot([p["step"] for p in ps], [p["mean"] for p in ps], marker="o", label=f"{arm} ({cond})",
                            linestyle="-" if cond != "low" else ":")
            ax.fill_between([p["step"] for p in ps], [p["ci"][0] for p in ps], [p["ci"][1] for p in ps],
                            color=line.get_color(), alpha=0.12)
    ax.set(title="sampled reward on fixed training prompts (95%)", xlabel="RL step",
           ylabel="share of rollouts with reward 1", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    if not arms:
        for a in axes.flat[1:]:
            a.text(0.5, 0.5, "RL arms not run yet\n(--parts sft,sweep,arms)", ha="center", va="center",
                   transform=a.transAxes, color="0.4")
    panels = ((axes[1][0], "zero_var_frac", "zero-variance share of groups", "share of the step's groups"),
              (axes[1][1], "entropy", "policy entropy on generated tokens", "nats per token"))
    for ax, key, title, unit in panels:
        for i, (arm, a) in enumerate(arms.items()):
            st = a["steps"]
            # a small offset per arm keeps coinciding lines (e.g. all at 0 or 1) apart
            offset = 0.01 * (i - 1.5) if key == "zero_var_frac" else 0.0
            ax.plot([x["step"] for x in st], [x.get(key, math.nan) + offset for x in st], marker=".", label=arm)
        ax.set(title=title + " per RL step", xlabel="RL step", ylabel=unit)
        ax.legend(fontsize=7)
    ax = axes[2][0]
    for arm, a in arms.items():
        st = [x for x in a["steps"] if "reward_mean_low" in x]
        if st:  # 5 rollouts per token and prompt each step: a running mean makes the trend readable
            steps = [x["step"] for x in st]
            high, low = [x["reward_mean_high"] for x in st], [x["reward_mean_low"] for x in st]
            line, = ax.plot(steps, running_mean(high), label=f"{arm}: high")
            ax.plot(steps, running_mean(low), linestyle=":", color=line.get_color(), label=f"{arm}: low")
            ax.plot(steps, running_mean([h - lo for h, lo in zip(high, low)]), linestyle="--", marker=".",
                    color=line.get_color(), label=f"{arm}: high - low")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(title="the step's own rollouts by token (5-step running mean)", xlabel="RL step",
           ylabel="mean reward of the step's rollouts")
    if any("reward_mean_low" in x for a in arms.values() for x in a["steps"]):
        ax.legend(fontsize=7)
    ax = axes[2][1]
    for arm, a in arms.items():
        st = a["steps"]
        line, = ax.plot([x["step"] for x in st], [max(x.get("kl", 0.0), 1e-8) for x in st], marker=".",
                        label=f"{arm}: KL")
        clip = [x.get("clip_frac", 0.0) for x in st]
        # Every arm's all-zero clip fraction lies on the same 1e-8 line: the legend says so.
        ax.plot([x["step"] for x in st], [max(c, 1e-8) for c in clip], linestyle=":", color=line.get_color(),
                label=f"{arm}: clip fraction" + ("" if any(clip) else " (all zero)"))
    ax.set(title="KL to the reference (k3, per token) and clip fraction", xlabel="RL step",
           ylabel="nats per token / share of tokens (log; 0 drawn at 1e-8)", yscale="log")
    ax.legend(fontsize=7)
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the study


def collect(args, parts: set[str], earlier_arms: dict) -> dict:
    """Run the named parts (those finished are read, not re-run) and gather
    every finished part's results. `earlier_arms` (the arms of the report
    being rewritten) stand in for arms whose run folders are not here."""
    results: dict = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                  if k not in ("worker", "model", "result", "report_only")}}
    results["rctp"] = {}
    rctp_run = args.out / f"rctp-{args.rl_start_source}"  # the RCTP arms start from its checkpoint
    for source in SOURCES:
        run = args.out / f"rctp-{source}"
        if "rctp" in parts:
            rctp_part(args, source)
        if not done(args, run.name, "rctp"):
            continue
        rows = records(run, "rctp")
        steer_rows = [r for r in rows if "steer" in r]
        data = json.loads((run / "stages" / "rctp-data.done").read_text())
        times = [r["time"] for r in rows if "time" in r]
        results["rctp"][source] = {"steer": steer_rows, "data": data,
                                   "minutes": round((max(times) - min(times)) / 60, 1) if times else None}
        if "gap" in parts or (args.out / "parts" / f"gap-{run.name}.json").exists():
            results["rctp"][source]["gap"] = gap_part(args, run)
        if run == rctp_run:  # the RL arms' start, and its gap
            start = rl_start(args, run, materialise=False)
            results["rl_start"] = {"source": source, "step": args.rl_start_step,
                                   "model": str(start / "models" / "rctp")}
            measured = (args.out / "parts" / f"gap-{run.name}-{start.name}.json").exists()
            if start != run and ("gap" in parts or measured):
                results["rl_start"]["gap"] = gap_part(args, rl_start(args, run, materialise=not measured))
    if "rctp" in parts:
        late_divergence_part(args)
    if done(args, "data-late_divergence", "rctp-data"):
        results["late_divergence"] = json.loads(
            (args.out / "data-late_divergence" / "stages" / "rctp-data.done").read_text())
    if "sft" in parts:
        sft_part(args)
    rl_parts = bool({"sweep", "arms"} & parts)
    rctp_start = rl_start(args, rctp_run, materialise=rl_parts) if done(args, rctp_run.name, "rctp") else None
    results["sweep"] = {}
    for lr in args.sweep_lrs.split(","):
        name = f"sweep-{lr}"
        if "sweep" in parts and rctp_start is not None:
            train(args, name, "rc-grpo", rl_flags(args, "rctp+rc-grpo", rctp_start, float(lr), args.sweep_steps,
                                                  args.sweep_steps))
        results["sweep"][lr] = probes(records(args.out / name, "rc-grpo"), "high")
    results["lr"] = sweep_choice(results["sweep"])
    results["arms"] = {}
    for arm, (start, stage) in ARMS.items():
        name = f"arm-{arm.replace('+', '_')}"
        start_run = rctp_start if start == "rctp" else args.out / "sft"
        if "arms" in parts and results["lr"] is not None and start_run is not None and (
                start == "rctp" or done(args, start_run.name, start)):
            train(args, name, stage, rl_flags(args, arm, start_run, results["lr"], args.steps, args.eval_every))
        rows = records(args.out / name, stage)
        if rows:
            conditionings = ["high", "low"] if start == "rctp" else ["none"]
            remeasured = {}
            for step in faulty_probe_steps(rows):
                part = remeasured_probe(args, args.out / name, step)
                if "arms" in parts and done(args, name, stage):
                    remeasure_part(args, args.out / name, stage, step, conditionings)
                if part.exists():
                    remeasured[step] = json.loads(part.read_text())
            results["arms"][arm] = summarise_arm(rows, conditionings[0], remeasured)
        elif arm in earlier_arms:
            results["arms"][arm] = earlier_arms[arm]
    results["dynamics"] = dynamics(results["arms"], args.batch_size)
    return results


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        out = worker_gap(args)
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(out, indent=1))
        return 0
    parts = set() if args.report_only else {p for p in args.parts.split(",") if p}
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; known: {list(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    # The report being rewritten: an arm whose run folder is not here (runs/
    # is git-ignored: a clone holds only the folders committed with the
    # study) keeps its figures from it, so a rewrite loses nothing.
    report_path = args.out / "learning.json"
    earlier = json.loads(report_path.read_text()) if report_path.exists() else {}
    t0 = time.time()
    results = collect(args, parts, earlier.get("arms", {}))
    if parts:
        results["minutes"] = round((time.time() - t0) / 60, 1)
    elif earlier:
        results["minutes"] = earlier.get("minutes")
    report_path.write_text(json.dumps(results, indent=1))
    md = report(results)
    (args.out / "learning.md").write_text(md)
    plot(results, args.out / "learning.png")
    print(md, f"\n{args.out / 'learning.md'}, {args.out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
