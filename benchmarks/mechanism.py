"""The mechanism of RC-GRPO, measured on CPU with the small model.

    python benchmarks/mechanism.py                  # defaults below; ~75 min on 2 cores
    python benchmarks/mechanism.py --report-only    # rewrite the table from finished parts

The paper's claim (arXiv 2602.03025): after SFT on experts, GRPO's groups of rollouts tend to earn
identical rewards (all solve or all fail), so their advantages are 0 and they
give no gradient; RC-GRPO draws each rollout's reward token with p = 0.5, and
the RCTP policy behaves differently under the two tokens, which keeps reward
variance inside groups.

What this script measures (every part in its own subprocess, so memory is
returned; re-running skips finished parts):

1. Checkpoints. The embedded SmolLM2-135M fine-tuned on a few short training
   entries (`--entries`) through the real trainer (`python -m rcgrpo.train`):
   SFT on the experts, and RCTP on experts + failures, reward-tagged.
2. (a) Token controllability of the RCTP checkpoint: rollouts sampled at the
   RL temperature on its training entries under `<|high_reward|>` and under
   `<|low_reward|>`, mean reward per token with 95% Wilson intervals.
   Teacher-forced probes on the RCTP records (each under its own tag and under
   the swapped one): KL(p_tag || p_swapped) of the next-token distributions
   over the assistant tokens, at the first one, and the log-likelihood
   margin, before RCTP (the token-extended base) and after (RCTP; SFT as a
   control that never saw the tokens); and at the first token where each
   entry's expert and failure records part, how far the tag moves the
   preference between the two choices (`first_divergences`).
3. (b) Zero-variance share of groups sampled from each arm's starting
   checkpoint with that arm's conditioning (SFT + no token; RCTP + always
   high; RCTP + p = 0.5), same prompts and seeds: `--groups` groups of G.
4. (c) The RL stage of each arm for `--steps` steps (reward and zero-variance
   share per step, from the trainer's metrics.jsonl). The fourth arm,
   sft+grpo-ds, is GRPO after SFT with dynamic sampling (`--ds-max-draws`
   rollout rounds per step at most); its zero-variance share is that of each
   step's scheduled prompts, before any group is dropped.

`--arms` runs only the named arms (their checkpoints, samples and RL stages)
and merges them into an existing mechanism.json; (a) is re-measured only when
an RCTP arm is named.

It writes `mechanism.json`, `mechanism.md` and `mechanism.png` into --out.
Results are whatever was measured; nothing here expects a direction.
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

# The shortest training entries of `base` (two turns, ~2.2k tokens each with
# compact docs without response schemas): the cheapest that exercise the
# multi-turn loop. Listed by `rcgrpo.data.rctp.expert_records` token counts.
DEFAULT_ENTRIES = ["multi_turn_base_100", "multi_turn_base_104", "multi_turn_base_105", "multi_turn_base_132"]
# arm -> (starting checkpoint, conditioning of its rollouts)
ARMS = {"sft+grpo": ("sft", "none"), "rctp+grpo": ("rctp", "high"), "rctp+rc-grpo": ("rctp", "mixed"),
        # DAPO's remedy for the same problem: GRPO after SFT, zero-variance groups dropped and redrawn.
        "sft+grpo-ds": ("sft", "none")}
Z95 = 1.959964


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/mechanism"), help="parent folder of every part")
    p.add_argument("--entries", default=",".join(DEFAULT_ENTRIES), help="comma-separated training entry ids")
    p.add_argument("--groups", type=int, default=24, help="(b): groups sampled per arm (a multiple of the entries)")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per group (G)")
    p.add_argument("--steps", type=int, default=3, help="(c): RL steps per arm")
    p.add_argument("--batch-size", type=int, default=2, help="(c): prompts per RL step")
    p.add_argument("--rl-lr", type=float, default=1e-6, help="RL learning rate (paper: 1e-6)")
    p.add_argument("--ft-lr", type=float, default=1e-4,
                   help="SFT/RCTP learning rate (higher than the paper's 1e-5: a few epochs must fit a few entries)")
    p.add_argument("--ft-epochs", type=int, default=5, help="SFT and RCTP epochs (the paper's RCTP: 5)")
    p.add_argument("--ft-batch-size", type=int, default=2, help="trajectories per fine-tuning step")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the RL rollouts')")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ds-max-draws", type=int, default=3, help="(c) sft+grpo-ds: rollout rounds per step at most")
    p.add_argument("--arms", default=",".join(ARMS),
                   help="comma-separated arms to run; others are kept from an earlier mechanism.json")
    p.add_argument("--report-only", action="store_true", help="only re-read finished parts and rewrite the report")
    p.add_argument("--worker", choices=["sample", "probe"], help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--conditioning", choices=["none", "high", "low", "mixed"], help=argparse.SUPPRESS)
    p.add_argument("--records", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------- statistics


def wilson(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion k / n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + Z95 ** 2 / (2 * n)) / (1 + Z95 ** 2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / (1 + Z95 ** 2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float]:
    """95% interval of p1 - p2 from the two Wilson intervals (Newcombe's method 10)."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1)
    l2, u2 = wilson(k2, n2)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


# -------------------------------------------------------------------- workers


def worker_sample(args) -> dict:
    """Groups of rollouts of `args.model` under one conditioning, on the
    study's entries, each entry played `groups / len(entries)` times; the
    same prompts, order and seeds for every model and conditioning."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rcgrpo.envs.bfcl import load_entries, split_train_test
    from rcgrpo.evaluation.rollouts import named_entries
    from rcgrpo.models import load_tokenizer
    from rcgrpo.reward_tokens import HIGH_REWARD, LOW_REWARD, DrawPerRollout
    from rcgrpo.rollout import make_engine
    from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes

    ids = args.entries.split(",")
    train, _ = split_train_test(load_entries(["base"]))
    entries = named_entries(train, ids, "--entries", "training entries of base")
    plays = [e for _ in range(args.groups // len(entries)) for e in entries]
    tokens = {"none": None, "high": HIGH_REWARD, "low": LOW_REWARD,
              "mixed": DrawPerRollout(p_high=0.5)}[args.conditioning]
    engine = make_engine("auto", args.model, dtype="float32", max_model_len=args.max_total_tokens, seed=args.seed)
    config = RolloutConfig(max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
                           temperature=args.temperature, seed=args.seed, doc_style="compact_no_response")
    t0 = time.time()
    rollouts = run_episodes(engine, load_tokenizer(args.model), plays, args.group_size, config, reward_tokens=tokens)
    groups = [[r.reward for r in rollouts if r.group == g] for g in range(len(plays))]
    return {"model": str(args.model), "conditioning": args.conditioning, "seconds": round(time.time() - t0, 1),
            "groups": groups, "entries": [e.id for e in plays],
            "by_token": {t: [r.reward for r in rollouts if (r.reward_token or "none") == t]
                         for t in {r.reward_token or "none" for r in rollouts}},
            "end_reasons": sorted({r.end_reason for r in rollouts})}


def worker_probe(args) -> dict:
    """Teacher-forced: each RCTP record under its own tag and under the other
    tag (one token of the prompt swapped); over its assistant tokens, the KL
    of the two next-token distributions and the log-likelihood margin."""
    import torch

    from rcgrpo.data.rctp import load_records
    from rcgrpo.models import load_policy, reward_token_ids
    from rcgrpo.reward_tokens import HIGH_REWARD, LOW_REWARD

    policy = load_policy(args.model)
    model, ids = policy.model.eval(), reward_token_ids(policy.tokenizer)
    swap = {ids[HIGH_REWARD]: ids[LOW_REWARD], ids[LOW_REWARD]: ids[HIGH_REWARD]}
    rows = []
    with torch.no_grad():
        for rec in load_records(args.records):
            tag_at = [i for i, t in enumerate(rec.token_ids) if t in swap]
            assert len(tag_at) == 1, f"{rec.entry_id}: {len(tag_at)} reward tokens in the record"
            other = list(rec.token_ids)
            other[tag_at[0]] = swap[other[tag_at[0]]]
            # position i predicts token i + 1: the assistant tokens' predicting positions
            pos = torch.tensor([i - 1 for i, m in enumerate(rec.sampled_mask) if m and i > 0])
            targets = torch.tensor(rec.token_ids)[pos + 1]
            logps = []
            for seq in (rec.token_ids, other):
                hidden = model.model(input_ids=torch.tensor([seq])).last_hidden_state[0, pos]
                logps.append(model.lm_head(hidden).float().log_softmax(-1))
            own, swapped = logps
            kl = (own.exp() * (own - swapped)).sum(-1)
            margin = own.gather(1, targets[:, None]) - swapped.gather(1, targets[:, None])
            rows.append({"entry_id": rec.entry_id, "kind": rec.kind, "tag": rec.reward_token,
                         "kl_mean": float(kl.mean()), "kl_first": float(kl[0]),
                         "margin_mean": float(margin.mean()), "margin_sum": float(margin.sum()),
                         "tokens": int(pos.numel())})
        divergences = first_divergences(model, load_records(args.records), ids[HIGH_REWARD], ids[LOW_REWARD])
    emb = model.get_input_embeddings().weight
    cos = torch.nn.functional.cosine_similarity(emb[ids[HIGH_REWARD]], emb[ids[LOW_REWARD]], dim=0)
    return {"model": str(args.model), "rows": rows, "cosine_high_low": float(cos),
            "kl_mean": sum(r["kl_mean"] for r in rows) / len(rows),
            "kl_first": sum(r["kl_first"] for r in rows) / len(rows),
            "margin_mean": sum(r["margin_mean"] for r in rows) / len(rows),
            "divergences": divergences,
            "steer_mean": sum(d["steer"] for d in divergences) / max(len(divergences), 1)}


def first_divergences(model, records, high: int, low: int) -> list[dict]:
    """Where an entry's expert (high-tagged) and failure (low-tagged) records
    first part, the decision the tag should steer. With the shared prefix
    under each tag: preference = log p(expert's token) - log p(failure's
    token); steer = preference under high - preference under low (> 0: the
    high tag pushes towards the expert's choice, in nats)."""
    import torch

    from rcgrpo.reward_tokens import HIGH_REWARD

    by_entry: dict[str, dict[str, object]] = {}
    for rec in records:
        by_entry.setdefault(rec.entry_id, {})["expert" if rec.reward_token == HIGH_REWARD else "failure"] = rec
    out = []
    for entry_id, pair in sorted(by_entry.items()):
        if len(pair) != 2:
            continue
        e, f = pair["expert"].token_ids, pair["failure"].token_ids
        tag = next(i for i, t in enumerate(e) if t == high)
        j = next((i for i in range(tag + 1, min(len(e), len(f))) if e[i] != f[i]), None)
        if j is None or not (pair["expert"].sampled_mask[j] and pair["failure"].sampled_mask[j]):
            continue  # no divergence, or not at a sampled token
        prefs = {}
        for name, token in (("high", high), ("low", low)):
            prefix = list(e[:j])
            prefix[tag] = token
            logp = model(input_ids=torch.tensor([prefix])).logits[0, -1].float().log_softmax(-1)
            prefs[name] = float(logp[e[j]] - logp[f[j]])
        out.append({"entry_id": entry_id, "position": j, "pref_high": prefs["high"], "pref_low": prefs["low"],
                    "steer": prefs["high"] - prefs["low"]})
    return out


# --------------------------------------------------------------- orchestration


def sh(cmd: list[str], log: Path, retries: int = 2) -> None:
    """One subprocess, its output appended to `log`. A run killed by a signal
    (e.g. the OOM killer on a shared machine) is started again (the trainer
    resumes) up to `retries` times; any other failure stops the study."""
    print("$", " ".join(map(str, cmd)), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=dict(os.environ, RCGRPO_PROGRESS="0"))
        for line in proc.stdout:
            f.write(line)
            if line.startswith(("[", "rcgrpo", "run folder")) and "|" not in line:
                sys.stdout.write(line)
    if proc.wait() < 0 and retries > 0:
        print(f"killed by signal {-proc.returncode}: starting again", flush=True)
        if "rcgrpo.train" in cmd and "--resume" not in cmd:
            # The killed run's folder exists now: continue it rather than start a second one.
            cmd = [*cmd, "--resume"]
        return sh(cmd, log, retries - 1)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[2]} failed (exit {proc.returncode}); its log: {log}")


def common_flags(args) -> list[str]:
    """Settings every trainer run of the study shares (the cpu-small preset plus the study's subset)."""
    return ["--preset", "cpu-small", "--fused", "--out-dir", args.out, "--data.categories", "base",
            "--data.entry_ids", args.entries, "--data.seed", args.seed,
            "--grpo.max_new_tokens", args.max_new_tokens, "--grpo.max_total_tokens", args.max_total_tokens,
            "--grpo.temperature", args.temperature, "--rctp.failure_temperature", args.temperature,
            "--run.micro_batch_tokens", args.max_total_tokens, "--run.checkpoint_every", "2"]


def resume_flag(args, name: str) -> list[str]:
    """--resume continues a part a killed study left; a part not begun starts fresh
    (the trainer refuses to resume a run that does not exist)."""
    return ["--resume"] if (args.out / name / "config.json").exists() else []


def finetune(args, kind: str) -> Path:
    """The SFT or RCTP checkpoint (runs/<out>/<kind>/models/<kind>)."""
    pipeline = "sft+grpo" if kind == "sft" else "rctp+rc-grpo"
    model = args.out / kind / "models" / kind
    if not (args.out / kind / "stages" / f"{kind}.done").exists():
        section = f"--{kind}."
        sh([sys.executable, "-m", "rcgrpo.train", *common_flags(args), "--pipeline", pipeline,
            "--stages", "sft" if kind == "sft" else "rctp-data,rctp", "--name", kind, *resume_flag(args, kind),
            section + "lr", args.ft_lr, section + "epochs", args.ft_epochs, section + "batch_size", args.ft_batch_size,
            section + "warmup_ratio", "0"], args.out / "logs" / f"{kind}.txt")
    return model


def worker(args, mode: str, name: str, **flags) -> dict:
    """A worker subprocess, or its earlier result."""
    result = args.out / "parts" / f"{name}.json"
    if not result.exists():
        extra = [x for k, v in flags.items() for x in (f"--{k}", v)]
        sh([sys.executable, __file__, "--worker", mode, "--result", result, "--entries", args.entries,
            "--groups", args.groups, "--group-size", args.group_size, "--temperature", args.temperature,
            "--max-new-tokens", args.max_new_tokens, "--max-total-tokens", args.max_total_tokens,
            "--seed", args.seed, *extra], args.out / "parts" / f"{name}.log")
    return json.loads(result.read_text())


def rl_arm(args, arm: str, start: Path) -> list[dict]:
    from rcgrpo.config import PIPELINES, RL_STAGES
    from rcgrpo.metrics import read_records

    name = f"arm-{arm.replace('+', '_')}"
    rl_stage = next(s for s in PIPELINES[arm] if s in RL_STAGES)
    ds = ["--grpo.dynamic_sampling_max_draws", args.ds_max_draws] if arm.endswith("-ds") else []
    if not (args.out / name / "stages" / f"{rl_stage}.done").exists():
        sh([sys.executable, "-m", "rcgrpo.train", *common_flags(args), "--pipeline", arm, "--stages", rl_stage,
            "--model", start, "--name", name, *resume_flag(args, name), "--grpo.steps", args.steps,
            "--grpo.batch_size", args.batch_size, "--grpo.group_size", args.group_size, "--grpo.lr", args.rl_lr,
            *ds], args.out / "logs" / f"{name}.txt")
    records, _ = read_records(args.out / name / "metrics.jsonl")
    keys = ("step", "zero_var_frac", "reward_mean", "reward_mean_high", "reward_mean_low", "adv_std", "kl",
            "entropy", "rollout_s", "update_s", "updates", "ds_draws", "ds_prompts_drawn", "ds_groups_kept",
            "ds_groups_dropped", "logp_diff_abs_mean")
    return [{k: r[k] for k in keys if k in r} for r in records if r.get("stage") == rl_stage]


# --------------------------------------------------------------------- report


def zero_variance(groups: list[list[float]]) -> dict:
    zero = sum(len(set(g)) == 1 for g in groups)
    lo, hi = wilson(zero, len(groups))
    return {"zero": zero, "groups": len(groups), "share": zero / len(groups), "ci": [lo, hi],
            "all_fail": sum(max(g) == 0 for g in groups), "all_solve": sum(min(g) == 1 for g in groups),
            "reward_mean": sum(map(sum, groups)) / sum(map(len, groups))}


def rate(rewards: list[float]) -> dict:
    k = int(sum(r >= 1 for r in rewards))
    lo, hi = wilson(k, len(rewards))
    return {"k": k, "n": len(rewards), "mean": k / len(rewards) if rewards else 0.0, "ci": [lo, hi]}


def report(results: dict) -> str:
    s = results["settings"]
    lines = [f"Entries: {s['entries']}; sampling T = {s['temperature']}, G = {s['group_size']}, "
             f"max {s['max_new_tokens']} new tokens per reply; fine-tuning {s['ft_epochs']} epochs at lr {s['ft_lr']}.",
             ""]
    a = results.get("controllability")
    if a:
        hi, lo = a["high"], a["low"]
        d = a["difference"]
        lines += ["**(a) Token controllability of the RCTP checkpoint** (sampled reward on its training entries)", "",
                  "| token | rollouts | reward | 95% interval |", "|---|---|---|---|",
                  f"| `<\\|high_reward\\|>` | {hi['n']} | {hi['mean']:.3f} | [{hi['ci'][0]:.3f}, {hi['ci'][1]:.3f}] |",
                  f"| `<\\|low_reward\\|>` | {lo['n']} | {lo['mean']:.3f} | [{lo['ci'][0]:.3f}, {lo['ci'][1]:.3f}] |",
                  "", f"high - low = {d['value']:+.3f}, 95% interval [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] "
                  f"(Newcombe). The paper's bound then gives E[std_g^2] >= {a['variance_bound']:.4f} "
                  f"(0.5 x 0.5 x (G-1)/G x e^2).", ""]
    probes = results.get("probes")
    if probes:
        lines += ["Teacher-forced probes on the RCTP records (own tag vs swapped tag):", "",
                  "| model | cosine(high, low rows) | KL per assistant token | KL at the first one | "
                  "log-lik. margin per token |", "|---|---|---|---|---|"]
        for name, p in probes.items():
            lines.append(f"| {name} | {p['cosine_high_low']:.4f} | {p['kl_mean']:.2e} | {p['kl_first']:.2e} | "
                         f"{p['margin_mean']:+.2e} |")
        lines += ["", "At the first token where an entry's expert and failure records part (the decision the tag "
                  "should steer): preference = log p(expert's token) - log p(failure's token) under each tag; "
                  "steer = preference under high - under low (nats, mean over the entries):", "",
                  "| model | entries | preference under high | under low | steer | steer per entry |",
                  "|---|---|---|---|---|---|"]
        for name, p in probes.items():
            d = p.get("divergences", [])
            if d:
                mean = lambda k: sum(x[k] for x in d) / len(d)  # noqa: E731
                each = ", ".join(format(x["steer"], "+.2f") for x in d)
                lines.append(f"| {name} | {len(d)} | {mean('pref_high'):+.3f} | {mean('pref_low'):+.3f} | "
                             f"{mean('steer'):+.3f} | {each} |")
        lines.append("")
    b = results.get("zero_variance")
    if b:
        lines += ["**(b) Zero-variance groups at each arm's start** (same prompts and seeds)", "",
                  "| arm | start, conditioning | groups | zero-variance share (95%) | all fail / all solve | reward |",
                  "|---|---|---|---|---|---|"]
        for arm, z in b.items():
            start, cond = ARMS[arm]
            lines.append(f"| {arm} | {start.upper()}, {cond} | {z['groups']} | {z['share']:.2f} "
                         f"[{z['ci'][0]:.2f}, {z['ci'][1]:.2f}] | {z['all_fail']} / {z['all_solve']} | "
                         f"{z['reward_mean']:.3f} |")
        lines.append("")
    c = results.get("rl")
    if c:
        lines += ["**(c) RL steps** (batch {} x G {}, lr {})".format(s["batch_size"], s["group_size"], s["rl_lr"]), "",
                  "| arm | step | zero-variance share | reward | high / low | KL | entropy | "
                  "dynamic sampling: draws, prompts, groups kept |",
                  "|---|---|---|---|---|---|---|---|"]
        for arm, rows in c.items():
            for r in rows:
                hl = " / ".join(f"{r[k]:.2f}" if k in r else "-" for k in ("reward_mean_high", "reward_mean_low"))
                ds = (f"{r['ds_draws']}, {r['ds_prompts_drawn']}, {r['ds_groups_kept']}"
                      + ("" if r.get("updates", 1) else " (no update)")) if "ds_draws" in r else "-"
                lines.append(f"| {arm} | {r['step']} | {r['zero_var_frac']:.2f} | {r['reward_mean']:.3f} | {hl} | "
                             f"{r.get('kl', 0.0):.2e} | {r.get('entropy', 0.0):.3f} | {ds} |")
    return "\n".join(lines) + "\n"


def error_bar(value: float, ci: list[float]) -> list[list[float]]:
    """matplotlib's asymmetric yerr; rounding can put a bound a hair past the value."""
    return [[max(0.0, value - ci[0])], [max(0.0, ci[1] - value)]]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rcgrpo.reward_tokens import REWARD_TOKENS

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    a = results.get("controllability")
    if a:
        for x, key in enumerate(("high", "low")):
            r = a[key]
            axes[0].bar(x, r["mean"], color=("tab:green", "tab:red")[x])
            axes[0].errorbar(x, r["mean"], yerr=error_bar(r["mean"], r["ci"]), color="k",
                             capsize=6)
        axes[0].set(xticks=[0, 1], xticklabels=list(REWARD_TOKENS), ylim=(0, 1),
                    title="(a) RCTP: sampled reward by token (95%)")
    b = results.get("zero_variance", {})
    for x, z in enumerate(b.values()):
        axes[1].bar(x, z["share"])
        axes[1].errorbar(x, z["share"], yerr=error_bar(z["share"], z["ci"]), color="k",
                         capsize=6)
    axes[1].set(xticks=range(len(b)), xticklabels=list(b), ylim=(0, 1.05), title="(b) zero-variance groups at start")
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]
    for k, (arm, rows) in enumerate(results.get("rl", {}).items()):
        marker, dash = styles[k % len(styles)]
        axes[2].plot([r["step"] + 0.04 * (k - 1) for r in rows], [r["zero_var_frac"] for r in rows],
                     marker=marker, linestyle=dash, label=f"{arm} zero-var")
        axes[2].plot([r["step"] + 0.04 * (k - 1) for r in rows], [r["reward_mean"] for r in rows],
                     marker=marker, linestyle=dash, alpha=0.4, label=f"{arm} reward")
    axes[2].set(title="(c) per RL step", xlabel="step", ylim=(-0.05, 1.05))
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        out = worker_sample(args) if args.worker == "sample" else worker_probe(args)
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(out, indent=1))
        return 0
    n_entries = len(args.entries.split(","))
    if args.groups % n_entries:
        raise SystemExit(f"--groups {args.groups} must be a multiple of the {n_entries} entries")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    t0 = time.time()
    results = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                            if k not in ("worker", "model", "conditioning", "records", "result")}}
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; known: {list(ARMS)}")
    if args.report_only:
        previous = json.loads((args.out / "mechanism.json").read_text())
        results = {**previous, "settings": previous["settings"]}
    elif set(arms) != set(ARMS):
        # Only some arms: everything else stays as the earlier run measured it.
        previous = json.loads((args.out / "mechanism.json").read_text())
        results = {**previous, "settings": {**previous["settings"], "ds_max_draws": args.ds_max_draws}}
        kinds = {ARMS[a][0] for a in arms}
        starts = {kind: finetune(args, kind) for kind in sorted(kinds)}
        for arm in arms:
            kind, cond = ARMS[arm]
            sample = worker(args, "sample", f"start-{arm}", model=starts[kind], conditioning=cond)
            results["zero_variance"][arm] = zero_variance(sample["groups"])
            results["sampling_seconds"][arm] = sample["seconds"]
            results["rl"][arm] = rl_arm(args, arm, starts[kind])
        results.setdefault("minutes_by_arms", {})[",".join(arms)] = round((time.time() - t0) / 60, 1)
    else:
        from rcgrpo.models import resolve_model_folder

        starts = {"sft": finetune(args, "sft"), "rctp": finetune(args, "rctp")}
        records = args.out / "rctp" / "rctp_data.jsonl"
        samples = {arm: worker(args, "sample", f"start-{arm}", model=starts[kind], conditioning=cond)
                   for arm, (kind, cond) in ARMS.items()}
        low = worker(args, "sample", "start-rctp-low", model=starts["rctp"], conditioning="low")
        hi_r, lo_r = rate(sum(samples["rctp+grpo"]["groups"], [])), rate(sum(low["groups"], []))
        lo_d, hi_d = newcombe(hi_r["k"], hi_r["n"], lo_r["k"], lo_r["n"])
        e = hi_r["mean"] - lo_r["mean"]
        g = args.group_size
        results["controllability"] = {"high": hi_r, "low": lo_r, "difference": {"value": e, "ci": [lo_d, hi_d]},
                                      "variance_bound": (g - 1) / g * 0.25 * e * e}
        results["probes"] = {
            "base (before RCTP)": worker(args, "probe", "probe-base", model=resolve_model_folder(None),
                                         records=records),
            "RCTP": worker(args, "probe", "probe-rctp", model=starts["rctp"], records=records),
            "SFT (never saw the tokens)": worker(args, "probe", "probe-sft", model=starts["sft"], records=records),
        }
        results["zero_variance"] = {arm: zero_variance(samples[arm]["groups"]) for arm in ARMS}
        results["sampling_seconds"] = {arm: samples[arm]["seconds"] for arm in ARMS}
        results["rl"] = {arm: rl_arm(args, arm, starts[kind]) for arm, (kind, _) in ARMS.items()}
        results["minutes"] = round((time.time() - t0) / 60, 1)
    (args.out / "mechanism.json").write_text(json.dumps(results, indent=1))
    md = report(results)
    (args.out / "mechanism.md").write_text(md)
    plot(results, args.out / "mechanism.png")
    print(md, f"\n{args.out / 'mechanism.md'}, {args.out / 'mechanism.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
