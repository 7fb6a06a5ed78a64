"""One RL step's update on a tiny model and real BFCL episodes: dynamic
sampling (kept groups, draws and counts, the cap, a step with nothing
informative), PPO epochs (the clip acts from the second pass), truncated
importance sampling in the trainer, and the engine/trainer agreement in
metrics.jsonl."""
import dataclasses
import json
from collections import defaultdict

import pytest
import torch

from rcgrpo.config import parse_args
from rcgrpo.data.expert import expert_turns, script_from_turns
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.pipeline.run import Run
from rcgrpo.pipeline.stages import train_rl_stage
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.rollout.engine import Generation
from rcgrpo.rollout.hf_engine import HFEngine
from rcgrpo.training.dynamic_sampling import dynamic_sampling
from rcgrpo.training.losses import RLLossSettings
from rcgrpo.training.optimizer import make_optimizer
from rcgrpo.training.parity import PARITY_TAIL
from rcgrpo.training.rl_loop import prompt_schedule
from rcgrpo.training.rl_update import UpdateSettings, rl_update, to_trajectories

FAIL_REPLY = "I cannot help with that."


@pytest.fixture(scope="module")
def base_entries():
    from rcgrpo.envs.bfcl import load_entries, split_train_test

    train, _ = split_train_test(load_entries(["base"]))
    # First turns that expect calls: a reply without one earns 0.
    return [e for e in train if e.ground_truth[0]][:4]


# ----------------------------------------------------------------- dynamic sampling, by itself


@dataclasses.dataclass
class FakeRollout:
    entry: int
    group: int
    reward: float


def fake_play(informative: set[int], log: list):
    """Rollouts of G = 2 whose rewards are fixed per prompt: (1, 0) for an
    informative entry, (0, 0) otherwise."""
    def play(indices, draw):
        log.append(list(indices))
        return [FakeRollout(e, g, float(k == 0 and e in informative)) for g, e in enumerate(indices) for k in range(2)]
    return play


def _run(first, informative, num_entries, batch_size, max_draws):
    log = [list(first)]
    first_rollouts = fake_play(informative, [])(first, 0)
    kept, counts = dynamic_sampling(fake_play(informative, log), first, first_rollouts, num_entries, batch_size,
                                    max_draws, seed=3)
    return kept, counts, log


def test_dynamic_sampling_fills_the_batch_from_fresh_prompts():
    kept, counts, log = _run([0, 1], set(range(2, 10)), 10, 3, 4)
    assert counts == {"ds_draws": 2, "ds_prompts_drawn": 5, "ds_groups_kept": 3, "ds_groups_dropped": 2}
    assert len(log[1]) == 3 and not set(log[1]) & {0, 1}  # the missing three, none played before
    assert [r.group for r in kept] == [0, 0, 1, 1, 2, 2]
    assert [r.entry for r in kept[::2]] == log[1]


def test_dynamic_sampling_honours_the_cap():
    kept, counts, log = _run([0, 3], {3}, 10, 2, 3)
    # one informative group kept, then one prompt per draw until the cap
    assert counts == {"ds_draws": 3, "ds_prompts_drawn": 4, "ds_groups_kept": 1, "ds_groups_dropped": 3}
    assert [len(x) for x in log] == [2, 1, 1] and len({e for x in log for e in x}) == 4
    assert [r.entry for r in kept] == [3, 3]


def test_dynamic_sampling_keeps_no_more_than_the_batch():
    kept, counts, _ = _run([4, 5, 6], {4, 5, 6}, 10, 2, 4)
    assert counts == {"ds_draws": 1, "ds_prompts_drawn": 3, "ds_groups_kept": 2, "ds_groups_dropped": 1}
    assert [r.entry for r in kept] == [4, 4, 5, 5]


def test_dynamic_sampling_repeats_prompts_only_once_all_were_played():
    _, counts, log = _run([0, 1], set(), 3, 2, 3)
    assert counts["ds_prompts_drawn"] == 6 and counts["ds_groups_kept"] == 0
    assert log[1][0] == 2  # the only fresh entry first


# ----------------------------------------------------------------- dynamic sampling in train_rl


class PerPromptEngine:
    """Scripted engine for many conversations at once: for an entry in
    `solvable`, every other new conversation replays the expert (reward 1) and
    the rest give up (reward 0); other entries always give up. Conversations
    are told apart by their token ids (each prompt extends its last one)."""

    name = "per-prompt"
    supports_sleep = False

    def __init__(self, tokenizer, entries, solvable):
        self.tok, self.eot = tokenizer, tokenizer.eos_token_id
        self.entries, self.solvable = entries, set(solvable)
        self.convs: list[dict] = []
        self.new = defaultdict(int)
        self.played: list[str] = []  # entry id of every new conversation

    def _entry_of(self, prompt):
        text = self.tok.decode(prompt)
        return next(e for e in self.entries if e.turns[0][0]["content"] in text)

    def generate(self, prompts, sampling):
        out = []
        for p in prompts:
            p = list(p)
            known = [c for c in self.convs if len(c["ids"]) <= len(p) and p[:len(c["ids"])] == c["ids"]]
            if known:
                conv = max(known, key=lambda c: len(c["ids"]))
            else:
                entry = self._entry_of(p)
                expert = entry.id in self.solvable and self.new[entry.id] % 2 == 0
                self.new[entry.id] += 1
                self.played.append(entry.id)
                conv = {"ids": p, "script": script_from_turns(expert_turns(entry)) if expert else [], "n": 0}
                self.convs.append(conv)
            text = conv["script"][conv["n"]] if conv["n"] < len(conv["script"]) else FAIL_REPLY
            conv["n"] += 1
            ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) + [self.eot]
            conv["ids"] = p + ids
            out.append([Generation(ids, None, "stop")])
        return out

    def load_weights(self, named):
        list(named)

    def sleep(self):
        pass

    def wake_up(self):
        pass


def _ds_run(tmp_path, tokenizer, tiny_folder, *flags):
    cfg = parse_args(["--fused", "--out-dir", str(tmp_path), "--name", "ds", "--pipeline", "sft+grpo-ds",
                      "--run.checkpoint_every", "0", "--run.report_to", "none", "--grpo.steps", "1",
                      "--grpo.batch_size", "2", "--grpo.group_size", "2", "--grpo.max_new_tokens", "64",
                      "--grpo.beta", "0", "--grpo.lr", "1e-3", "--grpo.eval_every", "0", *flags], check_files=False)
    assert cfg.grpo.dynamic_sampling
    ctx = Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=False)
    return cfg, ctx, policy


def _metrics(tmp_path):
    return [json.loads(x) for x in (tmp_path / "ds" / "metrics.jsonl").read_text().splitlines()]


def test_train_rl_with_dynamic_sampling_keeps_only_informative_groups(tmp_path, tokenizer, tiny_folder, base_entries,
                                                                       capsys):
    cfg, ctx, policy = _ds_run(tmp_path, tokenizer, tiny_folder, "--grpo.dynamic_sampling_max_draws", "4")
    scheduled = prompt_schedule(len(base_entries), 2, 1, cfg.data.seed)[0]
    # The two entries the schedule does not play first are the solvable ones:
    # round 1 keeps nothing, round 2 draws exactly them (fresh prompts first).
    solvable = [base_entries[i].id for i in range(len(base_entries)) if i not in scheduled]
    engine = PerPromptEngine(tokenizer, base_entries, solvable)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    train_rl_stage(ctx, "grpo", policy, engine, base_entries, finetune_stage="sft")
    (row,) = _metrics(tmp_path)
    assert (row["ds_draws"], row["ds_prompts_drawn"], row["ds_groups_kept"], row["ds_groups_dropped"]) == (2, 4, 2, 2)
    assert row["rollouts_played"] == 4 * 2  # every prompt drawn, G = 2
    assert sorted(set(engine.played[4:])) == sorted(solvable) and len(engine.played) == 8
    # Only the kept groups (rewards 1, 0 each) reached the loss: every advantage is +-1.
    assert row["adv_abs_mean"] == pytest.approx(1.0, abs=1e-5) and row["updates"] == 1
    # Reward statistics are those of the scheduled prompts (nothing solved there).
    assert row["zero_var_frac"] == 1.0 and row["reward_mean"] == 0.0
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
    # The stage's last line: it learned from the groups it kept, so no warning.
    err = capsys.readouterr().err
    assert "[grpo] done: 1 step; rollout reward 0; zero-variance groups 100% on average; " \
        "1 of 1 steps updated the weights" in err and "WARNING" not in err


def test_a_step_with_nothing_informative_makes_no_pass(tmp_path, tokenizer, tiny_folder, base_entries, capsys):
    cfg, ctx, policy = _ds_run(tmp_path, tokenizer, tiny_folder, "--grpo.dynamic_sampling_max_draws", "3")
    engine = PerPromptEngine(tokenizer, base_entries, solvable=[])
    passes = []
    hook = policy.model.register_forward_hook(lambda *_: passes.append(1))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    try:
        train_rl_stage(ctx, "grpo", policy, engine, base_entries, finetune_stage="sft")
    finally:
        hook.remove()
    (row,) = _metrics(tmp_path)
    assert (row["ds_draws"], row["ds_prompts_drawn"], row["ds_groups_kept"]) == (3, 6, 0)
    assert row["updates"] == 0 and "loss" not in row and "grad_norm" not in row
    assert "[grpo] WARNING: learned nothing from its rewards" in capsys.readouterr().err
    assert passes == []
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in policy.model.named_parameters())


# ----------------------------------------------------------------- PPO epochs, TIS, agreement


@pytest.fixture(scope="module")
def sampled(tiny_folder, tokenizer, base_entries):
    """Real sampled rollouts of the tiny model (HF engine, with its log-probs),
    two groups of two; their rewards are set to (1, 0) and (0, 1) so that the
    advantages are non-zero (the tiny model solves nothing)."""
    model = TrainablePolicy.load(tiny_folder, parse_args([], check_files=False).model, torch.device("cpu"),
                                 reference=False).model
    cfg = RolloutConfig(max_new_tokens=24, max_total_tokens=6144, doc_style="compact_no_response", progress=False,
                        seed=2)
    rollouts = run_episodes(HFEngine(model, tokenizer), tokenizer, base_entries[:2], group_size=2, config=cfg,
                            reward_tokens=None)
    assert all(r.logprobs is not None for r in rollouts)
    return [dataclasses.replace(r, reward=float(i in (0, 3))) for i, r in enumerate(rollouts)]


def _ctx(tmp_path, tokenizer, tiny_folder):
    cfg = parse_args(["--fused", "--out-dir", str(tmp_path), "--name", "u", "--run.report_to", "none"],
                     check_files=False)
    return Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)


def _fresh(tiny_folder):
    return TrainablePolicy.load(tiny_folder, parse_args([], check_files=False).model, torch.device("cpu"),
                                reference=False)


@pytest.mark.slow  # RL updates of 1 and 2 epochs on real episodes (~5 s)
def test_ppo_epochs_the_clip_acts_in_the_second_pass(tmp_path, tokenizer, tiny_folder, sampled):
    from rcgrpo.model.packing import pack

    ctx = _ctx(tmp_path, tokenizer, tiny_folder)
    settings = RLLossSettings(eps_low=0.2, eps_high=0.2, beta=0.0)
    trajectories = to_trajectories(sampled)
    results = {}
    for mu in (1, 2):
        policy = _fresh(tiny_folder)
        opt, sched = make_optimizer(policy, 3e-2, 0.0, 4, 0.0)
        policy.train_mode()
        results[mu] = (rl_update(policy, trajectories, ctx.step_settings(), settings,
                                 UpdateSettings(updates_per_batch=mu, max_grad_norm=0.0),
                                 optimizer=opt, scheduler=sched), policy, sched)
    two, _, sched2 = results[2]
    assert two["updates"] == 2 and sched2.last_epoch == 2
    # Pass 1 scores the weights the old log-probs came from: every ratio is 1.
    assert two["clip_frac_pass1"] == 0.0
    assert two["clip_frac_pass2"] > 0.0
    # Pass 2 sees the weights after one update, which mu = 1 reaches too (same
    # start, batch and step): its ratios against the pre-update log-probs give
    # the clipped share pass 2 reported.
    _, after_one, _ = results[1]
    batch = pack(trajectories)
    import rcgrpo_kernels
    from rcgrpo.training.rl_update import trainer_logprobs
    adv = rcgrpo_kernels.group_advantages(batch.rewards, batch.seq_group)
    old = trainer_logprobs(_fresh(tiny_folder), batch, ctx.step_settings(), 1.0)
    new = trainer_logprobs(after_one, batch, ctx.step_settings(), 1.0)
    m = batch.loss_mask
    ratio = torch.exp(new - old)[m]
    a = adv[rcgrpo_kernels.packing.sequence_ids(torch.nonzero(m).reshape(-1), batch.cu_seqlens)]
    clipped = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    assert two["clip_frac_pass2"] == pytest.approx(float(clipped.float().mean()), abs=1e-6)
    # Ratios moved both into and out of the clip range: the clip acts on some tokens only.
    assert 0 < float(clipped.float().mean()) < 1


@pytest.mark.slow  # three RL updates of the tiny model with a reference (~8 s)
def test_the_first_update_reads_the_reference_off_the_policys_own_pass(tmp_path, tokenizer, tiny_folder, sampled):
    """Before its first optimizer step the policy is its reference: that
    update takes the reference's log-probs from the policy's own pass (no
    reference forward) and lands exactly where the update with a reference
    pass lands. From the second step on the reference is forwarded."""
    ctx = _ctx(tmp_path, tokenizer, tiny_folder)
    trajectories = to_trajectories(sampled)
    after, passes, stats = {}, {}, {}
    for own in (True, False):
        policy = TrainablePolicy.load(tiny_folder, parse_args([], check_files=False).model, torch.device("cpu"),
                                      reference=True)
        assert policy.equals_reference
        policy.equals_reference = own  # False: the same weights, scored as if they had moved
        calls = []
        forward = policy.reference
        policy.reference = lambda forward=forward, calls=calls: (calls.append(1), forward())[1]
        opt, sched = make_optimizer(policy, 1e-3, 0.0, 2, 0.0)
        policy.train_mode()
        stats[own] = rl_update(policy, trajectories, ctx.step_settings(), RLLossSettings(beta=0.1), UpdateSettings(), optimizer=opt,
                               scheduler=sched)
        passes[own] = len(calls)
        after[own] = [p.detach().clone() for p in policy.trainable_parameters()]
        if own:
            second = rl_update(policy, trajectories, ctx.step_settings(), RLLossSettings(beta=0.1), UpdateSettings(), optimizer=opt,
                               scheduler=sched, step=1)
            assert len(calls) > 0 and second["kl"] > 0
    assert passes[True] == 0 and passes[False] > 0
    assert stats[True]["kl"] == stats[False]["kl"] == 0.0
    assert stats[True]["loss"] == stats[False]["loss"]
    assert all(torch.equal(a, b) for a, b in zip(after[True], after[False]))


@pytest.mark.slow  # RL updates on the module's sampled episodes (~2 s, and ~5 s to sample them)
def test_mini_batches_take_one_step_each(tmp_path, tokenizer, tiny_folder, sampled):
    ctx = _ctx(tmp_path, tokenizer, tiny_folder)
    policy = _fresh(tiny_folder)
    opt, sched = make_optimizer(policy, 1e-3, 0.0, 4, 0.0)
    policy.train_mode()
    out = rl_update(policy, to_trajectories(sampled), ctx.step_settings(), RLLossSettings(beta=0.0),
                    UpdateSettings(updates_per_batch=2, mini_batches=2), optimizer=opt, scheduler=sched)
    assert out["updates"] == 4 and sched.last_epoch == 4
    assert out["loss_tokens"] == sum(sum(r.sampled_mask) for r in sampled)


def _grads(policy):
    return torch.cat([p.grad.reshape(-1) for p in policy.trainable_parameters()])


@pytest.mark.slow  # shared and whole-sequence updates on real episodes (~2.5 s each)
@pytest.mark.parametrize("micro_batch_tokens", [4500, 16384])
def test_shared_prefixes_give_the_update_of_whole_sequences(tmp_path, tokenizer, tiny_folder, sampled,
                                                            micro_batch_tokens):
    """The RL update with each group's prompt forwarded once equals the one
    forwarding every sequence whole (gradient, loss, counts), with far fewer
    forwarded tokens. At 4,500 tokens a micro-batch holds one 2.8k-4.2k-token
    sequence, or one group when prompts are shared; at 16,384 all of them."""
    cfg = parse_args(["--fused", "--out-dir", str(tmp_path), "--name", "u", "--run.report_to", "none",
                      "--run.micro_batch_tokens", str(micro_batch_tokens)], check_files=False)
    ctx = Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)
    out, grads = {}, {}
    for share in (True, False):
        model_cfg = parse_args(["--model.share_prefixes", str(share).lower()], check_files=False).model
        policy = TrainablePolicy.load(tiny_folder, model_cfg, torch.device("cpu"), reference=False)
        assert policy.lm.shares_prefixes is share
        policy.train_mode()
        out[share] = rl_update(policy, to_trajectories(sampled), ctx.step_settings(), RLLossSettings(beta=0.0), UpdateSettings("group"))
        grads[share] = _grads(policy)
    assert out[True]["loss_tokens"] == out[False]["loss_tokens"]
    assert out[False]["forward_tokens"] == out[False]["batch_tokens"]
    assert out[True]["forward_tokens"] < 0.6 * out[False]["forward_tokens"]
    assert out[True]["loss"] == pytest.approx(out[False]["loss"], rel=1e-5, abs=1e-7)
    assert (grads[True] - grads[False]).norm() <= 1e-4 * grads[False].norm()
    assert grads[False].norm() > 0


@pytest.mark.slow  # three RL passes on real episodes (~2.4 s)
def test_tis_in_the_trainer(tmp_path, tokenizer, tiny_folder, sampled):
    """Engine log-probs equal to the trainer's: TIS changes nothing. Engine
    log-probs 1 nat below the trainer's on every other token: those weights are
    capped at 2, the rest are 1, and the gradient changes."""
    from rcgrpo.model.packing import pack
    from rcgrpo.training.rl_update import trainer_logprobs

    ctx = _ctx(tmp_path, tokenizer, tiny_folder)
    settings = RLLossSettings(beta=0.0)
    policy = _fresh(tiny_folder)
    policy.train_mode()
    trajectories = to_trajectories(sampled)
    own = trainer_logprobs(policy, pack(trajectories), ctx.step_settings(), 1.0)
    # Per-token values back onto each trajectory (the packed batch shifts by one).
    own_trajs, planted, start = [], [], 0
    for t in trajectories:
        n = len(t.token_ids)
        lp = [0.0] + own[start:start + n - 1].tolist()
        start += n
        own_trajs.append(dataclasses.replace(t, logprobs=lp))
        planted.append(dataclasses.replace(t, logprobs=[x - (1.0 if i % 2 else 0.0) for i, x in enumerate(lp)]))

    def grad_of(trajs, cap):
        for p in policy.trainable_parameters():
            p.grad = None
        stats = rl_update(policy, trajs, ctx.step_settings(), settings, UpdateSettings("group", tis_cap=cap))
        return _grads(policy).clone(), stats

    plain, _ = grad_of(own_trajs, None)
    same, s_same = grad_of(own_trajs, 2.0)
    assert s_same["logp_diff_abs_mean"] < 1e-5 and s_same["tis_capped_frac"] == 0.0
    assert s_same["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(same, plain, rtol=1e-4, atol=1e-7)
    moved, s_moved = grad_of(planted, 2.0)
    assert 0.3 < s_moved["tis_capped_frac"] < 0.7
    assert s_moved["tis_weight_mean"] == pytest.approx(1 + s_moved["tis_capped_frac"], abs=1e-4)
    assert not torch.allclose(moved, plain, rtol=1e-2)
    with pytest.raises(ValueError, match="tis_cap needs the engine's log-probs"):
        grad_of([dataclasses.replace(t, logprobs=None) for t in trajectories], 2.0)


@pytest.mark.slow  # RL steps of the tiny model with the agreement check (~9 s)
def test_every_rl_step_logs_the_agreement(tmp_path, tokenizer, tiny_folder, base_entries, capsys):
    cfg = parse_args(["--fused", "--out-dir", str(tmp_path), "--name", "agree", "--run.checkpoint_every", "0",
                      "--run.report_to", "none", "--grpo.steps", "2", "--grpo.batch_size", "1",
                      "--grpo.group_size", "2", "--grpo.max_new_tokens", "8", "--grpo.beta", "0.1",
                      "--grpo.tis_cap", "2", "--grpo.eval_every", "1", "--grpo.eval_rollouts", "3"], check_files=False)
    ctx = Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=True)
    # The tiny model earns reward 0 everywhere: a policy unlike its reference gives each
    # step a gradient (its KL term), so that no step is skipped and each scores its tokens.
    with torch.no_grad():
        policy.model.model.norm.weight.mul_(1.5)
    policy.equals_reference = False
    engine = HFEngine(_fresh(tiny_folder).model, tokenizer)
    train_rl_stage(ctx, "rc-grpo", policy, engine, base_entries[:1], finetune_stage="rctp")
    rows = [json.loads(x) for x in (tmp_path / "agree" / "metrics.jsonl").read_text().splitlines()]
    # The learning curve: before the first step, then after each (eval_every 1), under each reward
    # token (an rc-grpo stage after rctp); one entry played 3 times per token.
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for name in ("high", "low"):
            mean, lo, hi = (r[f"sampled_reward_{name}{end}"] for end in ("", "_lo", "_hi"))
            assert r[f"sampled_reward_{name}_n"] == 3 and 0.0 <= lo <= mean <= hi <= 1.0
        assert "sampled_reward_none" not in r
    rows = rows[1:]
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert [r["rollouts_played"] for r in rows] == [2, 2] and [r["update_skipped"] for r in rows] == [0, 0]
    for r in rows:
        # the HF engine samples with the same fp32 weights: rounding only
        assert 0 <= r["logp_diff_abs_mean"] < 1e-4 and r["logp_diff_over_0.1_frac"] == 0.0
        assert r["tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert {"seq_log_ratio_mean", "seq_log_ratio_abs_max", "tis_capped_frac"} <= set(r)
    # The tree parity oracle checked the stage's first update (its group shares the prompt), and only it.
    assert 0 <= rows[0]["tree_parity_max_abs"] <= rows[0]["tree_parity_bound"] == 1e-3
    # Checked on its sample (a window where a branch leaves its root), once.
    assert 0 < rows[0]["tree_parity_tokens"] <= 2 * PARITY_TAIL and "tree_parity_max_abs" not in rows[1]
    # The bar's last state carries the step's figures; the stage ends with its verdict.
    err = capsys.readouterr().err
    assert err.count("[rc-grpo] tree parity at step 1: max |log p tree - log p dense| ") == 1
    assert "rc-grpo: 100%" in err and "reward=0, high=0, low=0, zero_var=1, kl=" in err
    assert "[rc-grpo] done: 2 steps; rollout reward 0 -> 0 (" in err and "2 of 2 steps updated the weights" in err
    # Reward 0 everywhere: the weights moved (its KL term), but not from any reward.
    assert "[rc-grpo] WARNING: learned nothing from its rewards" in err


@pytest.mark.slow  # two RL updates on real episodes (~3 s)
def test_a_sum_loss_over_micro_batches_is_the_whole_batchs(tmp_path, tokenizer, tiny_folder, sampled):
    """A loss type that sums (token-sum) gives each micro-batch a weight of 1:
    split into one sequence per micro-batch, the update's gradient and loss
    equal the single micro-batch's, and its statistics stay per-token means
    (averaged by loss-token share, not summed)."""
    out, grads = {}, {}
    for tokens in (4500, 32768):  # one sequence per micro-batch, or all of them
        cfg = parse_args(["--fused", "--out-dir", str(tmp_path), "--name", f"u{tokens}", "--run.report_to",
                          "none", "--run.micro_batch_tokens", str(tokens), "--model.share_prefixes", "false"],
                         check_files=False)
        ctx = Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)
        policy = _fresh(tiny_folder)
        policy.train_mode()
        out[tokens] = rl_update(policy, to_trajectories(sampled), ctx.step_settings(), RLLossSettings(beta=0.0, loss_type="token-sum"),
                                UpdateSettings("rloo"))
        grads[tokens] = _grads(policy)
    assert out[4500]["loss"] == pytest.approx(out[32768]["loss"], rel=1e-5)
    assert (grads[4500] - grads[32768]).norm() <= 1e-4 * grads[32768].norm()
    assert out[4500]["entropy"] == pytest.approx(out[32768]["entropy"], rel=1e-4)
    assert 0.0 <= out[4500]["clip_frac"] <= 1.0
