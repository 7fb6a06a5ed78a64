"""The mechanism of RC-GRPO, measured on CPU with the small model.

    python benchmarks/mechanism.py                    # defaults below, ~1-2 h on 2 cores
    python benchmarks/mechanism.py --steps 2 --entries multi_turn_base_100,multi_turn_base_104

PAPER.md's claim: after SFT on experts, GRPO's groups of rollouts tend to earn
identical rewards (all solve or all fail), so their advantages are 0 and they
give no gradient; RC-GRPO draws each rollout's reward token with p = 0.5, and
the RCTP policy behaves differently under the two tokens, which keeps reward
variance inside groups.

What this script does, every part through the real trainer CLI
(`python -m rcgrpo.train`, one subprocess per run so memory is returned):

1. fine-tunes the embedded SmolLM2-135M on a few short training entries into
   an SFT-on-expert checkpoint and an RCTP checkpoint (expert + failure,
   reward-tagged), round after round until a greedy rollout solves at least
   one of those entries (or --max-rounds), checked with `python -m rcgrpo.eval`;
2. from those checkpoints runs the same number of steps of each arm
   (default: sft+grpo, rctp+grpo, rctp+rc-grpo) on the same prompts, same seed;
3. reads each arm's metrics.jsonl and writes mechanism.json, mechanism.md (the
   table for the README) and mechanism.png into --out.

Results are whatever was measured; nothing here expects a direction.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rcgrpo.metrics import read_records  # noqa: E402

# The shortest training entries of `base` (two turns, ~2.2k tokens each with
# compact docs without response schemas): the cheapest that exercise the
# multi-turn loop. Listed by `rcgrpo.data.rctp.expert_records` token counts.
DEFAULT_ENTRIES = ["multi_turn_base_100", "multi_turn_base_104", "multi_turn_base_105", "multi_turn_base_132"]
ARMS = ("sft+grpo", "sft+rc-grpo", "rctp+grpo", "rctp+rc-grpo")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/mechanism"), help="parent folder of every run")
    p.add_argument("--entries", default=",".join(DEFAULT_ENTRIES), help="comma-separated training entry ids")
    p.add_argument("--arms", default="sft+grpo,rctp+grpo,rctp+rc-grpo", help=f"comma-separated, from {ARMS}")
    p.add_argument("--steps", type=int, default=3, help="RL steps per arm")
    p.add_argument("--batch-size", type=int, default=2, help="prompts per RL step")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per prompt (G)")
    p.add_argument("--rl-lr", type=float, default=1e-6, help="RL learning rate (paper: 1e-6)")
    p.add_argument("--ft-lr", type=float, default=1e-4,
                   help="SFT/RCTP learning rate (higher than the paper's 1e-5: a few epochs must fit a few entries)")
    p.add_argument("--ft-epochs", type=int, default=3, help="fine-tuning epochs per round")
    p.add_argument("--ft-batch-size", type=int, default=2, help="trajectories per fine-tuning step")
    p.add_argument("--max-rounds", type=int, default=3, help="fine-tuning rounds until a greedy rollout solves an entry")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-only", action="store_true", help="only re-read finished arms and rewrite the table")
    args = p.parse_args(argv)
    bad = sorted(set(args.arms.split(",")) - set(ARMS))
    if bad:
        p.error(f"--arms: unknown {bad}; choose from {ARMS}")
    return args


def common_flags(args) -> list[str]:
    """Settings every run of the study shares (the cpu-small preset plus the study's subset)."""
    return [
        "--preset", "cpu-small", "--fused", "--out-dir", str(args.out),
        "--data.categories", "base", "--data.entry_ids", args.entries, "--data.seed", str(args.seed),
        "--grpo.max_new_tokens", str(args.max_new_tokens), "--grpo.max_total_tokens", str(args.max_total_tokens),
        "--run.micro_batch_tokens", str(args.max_total_tokens), "--run.checkpoint_every", "0",
    ]


def sh(cmd: list[str], log: Path, retries: int = 2) -> None:
    """Run one trainer/eval subprocess, its output appended to `log`. A run
    killed by a signal (e.g. the OOM killer on a shared machine) is resumed
    (every trainer command has --resume) up to `retries` times; any other
    failure stops the study."""
    print("$", " ".join(cmd), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            # Only the trainer's own lines reach the screen: tqdm redraws (text
            # mode turns their \r into lines) and vLLM's start-up chatter stay in the log.
            if line.strip() and "\x1b[" not in line and "|" not in line and not line.startswith(("(", "[W")):
                sys.stdout.write(line)
    if proc.wait() < 0 and retries > 0:
        print(f"killed by signal {-proc.returncode}: resuming", flush=True)
        return sh(cmd, log, retries - 1)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[2]} failed (exit {proc.returncode}); its log: {log}")


def greedy_solved(args, model: Path, conditioning: str) -> dict:
    """Greedy rollouts on the study's entries, scored by the official checker."""
    out = model.parent.parent / f"solve-{model.name}"
    sh([sys.executable, "-m", "rcgrpo.eval", "--model", str(model), "--split", "train", "--categories", "base",
        "--ids", args.entries, "--conditioning", conditioning, "--doc-style", "compact_no_response",
        "--max-new-tokens", str(args.max_new_tokens), "--max-total-tokens", str(args.max_total_tokens),
        "--out", str(out)], out / "log.txt")
    result = json.loads((out / "eval.json").read_text())
    return {"solved": sum(r["valid"] for r in result["rows"]), "of": len(result["rows"]),
            "reward": [r["reward"] for r in result["rows"]]}


def finetune_until_solving(args, kind: str) -> tuple[Path, list[dict]]:
    """SFT or RCTP checkpoint: rounds of `ft_epochs` epochs, each continuing
    from the last, until a greedy rollout solves an entry."""
    pipeline = "sft+grpo" if kind == "sft" else "rctp+rc-grpo"
    section = f"--{kind}."
    history, model, data_file = [], None, None
    for round_ in range(1, args.max_rounds + 1):
        name = f"{kind}-round{round_}"
        model_dir = args.out / name / "models" / kind
        if not model_dir.exists():
            stages = kind if kind == "sft" or data_file else "rctp-data,rctp"
            cmd = [sys.executable, "-m", "rcgrpo.train", *common_flags(args), "--pipeline", pipeline,
                   "--stages", stages, "--name", name, "--resume",
                   section + "lr", str(args.ft_lr), section + "epochs", str(args.ft_epochs),
                   section + "batch_size", str(args.ft_batch_size), "--run.checkpoint_every", "2"]
            if model is not None:
                cmd += ["--model", str(model)]
            if data_file is not None:
                cmd += ["--rctp.data_file", str(data_file)]
            sh(cmd, args.out / name / "log.txt")
        if kind == "rctp" and data_file is None:
            data_file = args.out / name / "rctp_data.jsonl"  # later rounds reuse the labelled set
        model = model_dir
        check = greedy_solved(args, model, "high" if kind == "rctp" else "none")
        history.append({"round": round_, "epochs": round_ * args.ft_epochs, **check})
        print(f"[{kind}] round {round_}: greedy solves {check['solved']}/{check['of']}", flush=True)
        if check["solved"]:
            break
    return model, history


def run_arm(args, arm: str, start: Path) -> Path:
    name = f"arm-{arm.replace('+', '_')}"
    rl_stage = arm.split("+")[1]
    if not (args.out / name / "stages" / f"{rl_stage}.done").exists():
        sh([sys.executable, "-m", "rcgrpo.train", *common_flags(args), "--pipeline", arm, "--stages", rl_stage,
            "--model", str(start), "--name", name, "--resume",
            "--grpo.steps", str(args.steps), "--grpo.batch_size", str(args.batch_size),
            "--grpo.group_size", str(args.group_size), "--grpo.lr", str(args.rl_lr)],
           args.out / name / "log.txt")
    return args.out / name


def arm_rows(run_dir: Path, rl_stage: str) -> list[dict]:
    records, _ = read_records(run_dir / "metrics.jsonl")
    keys = ("step", "zero_var_frac", "reward_mean", "reward_mean_high", "reward_mean_low", "adv_std", "kl", "entropy")
    return [{k: r[k] for k in keys if k in r} for r in records if r.get("stage") == rl_stage]


def table(results: dict) -> str:
    lines = ["| arm | start | steps | groups | zero-variance groups | reward (mean) | reward high / low token |",
             "|---|---|---|---|---|---|---|"]
    for arm, res in results["arms"].items():
        rows = res["steps"]
        if not rows:
            continue
        groups = len(rows) * results["settings"]["batch_size"]
        zero = sum(r["zero_var_frac"] for r in rows) / len(rows)
        reward = sum(r["reward_mean"] for r in rows) / len(rows)
        hi = [r["reward_mean_high"] for r in rows if "reward_mean_high" in r]
        lo = [r["reward_mean_low"] for r in rows if "reward_mean_low" in r]
        split = (f"{sum(hi) / len(hi):.2f} / {sum(lo) / len(lo):.2f}" if hi and lo
                 else f"{sum(hi) / len(hi):.2f} / -" if hi else "- / -")
        per_step = ", ".join(f"{r['zero_var_frac']:.2f}" for r in rows)
        lines.append(f"| {arm} | {arm.split('+')[0].upper()} | {len(rows)} | {groups} | "
                     f"{100 * zero:.0f}% (per step: {per_step}) | {reward:.3f} | {split} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    # Arms often coincide on a few steps: distinct markers, dashes and a small
    # sideways shift keep every arm visible.
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]
    for k, (arm, res) in enumerate(results["arms"].items()):
        marker, dash = styles[k % len(styles)]
        steps = [r["step"] + 0.04 * (k - 1) for r in res["steps"]]
        for ax, key in zip(axes, ("zero_var_frac", "reward_mean")):
            ax.plot(steps, [r[key] for r in res["steps"]], marker=marker, linestyle=dash, label=arm)
    for ax, title in zip(axes, ("groups with zero reward variance", "mean reward")):
        ax.set(title=title, xlabel="RL step", ylim=(-0.05, 1.05))
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    t0 = time.time()
    arms = args.arms.split(",")
    results = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "finetune": {},
               "arms": {}}
    starts = {}
    previous = args.out / "mechanism.json"
    if args.report_only and previous.exists():
        results["finetune"] = json.loads(previous.read_text()).get("finetune", {})
    for kind in sorted({a.split("+")[0] for a in arms}, reverse=True):  # sft first
        if args.report_only:
            rounds = sorted(args.out.glob(f"{kind}-round*/models/{kind}"))
            starts[kind] = rounds[-1] if rounds else None
            continue
        starts[kind], results["finetune"][kind] = finetune_until_solving(args, kind)
    for arm in arms:
        kind, rl_stage = arm.split("+")
        run_dir = args.out / f"arm-{arm.replace('+', '_')}"
        if not args.report_only:
            run_dir = run_arm(args, arm, starts[kind])
        results["arms"][arm] = {"start": str(starts[kind]),
                                "steps": arm_rows(run_dir, rl_stage) if (run_dir / "metrics.jsonl").exists() else []}
    results["minutes"] = round((time.time() - t0) / 60, 1)
    (args.out / "mechanism.json").write_text(json.dumps(results, indent=1))
    md = table(results)
    solved = "; ".join(f"{k.upper()}: greedy solves {h[-1]['solved']}/{h[-1]['of']} after {h[-1]['epochs']} epochs"
                       for k, h in results["finetune"].items() if h)
    (args.out / "mechanism.md").write_text(f"{md}\n\n{solved}\n")
    plot(results, args.out / "mechanism.png")
    print(md, "\n", solved, f"\n{args.out / 'mechanism.md'}, {args.out / 'mechanism.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
