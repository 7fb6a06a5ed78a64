"""An update moves probability the right way.

* GRPO / RC-GRPO: one update on real BFCL groups with mixed rewards (per
  entry: the scripted expert, a near miss and a rollout of the model, each
  scored by the environment, each under a reward token) raises the sequence
  log-probability of every positive-advantage rollout and lowers every
  negative one, measured before and after in eval mode; with the rewards
  flipped, the opposite. Fused and reference paths, one pass or two PPO
  epochs, full weights or LoRA.
* RCTP: training on an entry's expert under <|high_reward|> and its near
  miss under <|low_reward|> makes the high tag steer the first divergent
  token to the expert's choice; with the tags swapped, the other way.
* A step whose gradient is exactly zero (every group zero-variance while the
  policy is still its reference) makes no pass and leaves the weights
  bit-identical; after an update, a zero-variance step with beta > 0 still
  trains on its KL term.

The policy is a tiny random Llama with the real token-extended tokenizer
(the trainer's mechanics on real BFCL ids at a fraction of the 135M model's
cost).
"""
import dataclasses
import json
import math

import pytest
import torch

import rcgrpo_kernels
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.config import parse_args
from rcgrpo.data.divergence import divergences
from rcgrpo.data.expert import expert_turns, near_misses, play_script, script_from_turns
from rcgrpo.data.rctp import build_rctp
from rcgrpo.model.packing import pack
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.pipeline.run import Run
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.rollout.hf_engine import HFEngine
from rcgrpo.training.finetune import SteerProbe, finetune
from rcgrpo.training.losses import RLLossSettings
from rcgrpo.training.optimizer import make_optimizer
from rcgrpo.training.rl_update import UpdateSettings, rl_update, to_trajectories, trainer_logprobs

ENTRY_IDS = ("multi_turn_base_100", "multi_turn_base_105")  # short TradingBot entries, one system prompt
ROLLOUT = RolloutConfig(max_new_tokens=24, max_total_tokens=4096, doc_style="compact_no_response", progress=False,
                        seed=5)
LORA = ["--model.lora.enabled", "true", "--model.lora.r", "4", "--model.lora.alpha", "8",
        "--model.lora.dropout", "0.05", "--model.lora.target_modules", "q_proj,v_proj,down_proj"]


@pytest.fixture(scope="module")
def study_entries():
    from rcgrpo.envs.bfcl import load_entries, split_train_test

    train, _ = split_train_test(load_entries(["base"]))
    return [e for e in train if e.id in ENTRY_IDS]


@pytest.fixture(scope="module")
def groups(tiny_folder, tokenizer, study_entries):
    return real_groups(tiny_folder, tokenizer, study_entries)


def real_groups(folder, tokenizer, study_entries):
    """Two real groups, one per entry: the expert (reward 1, high tag), a near
    miss (the expert with a call dropped or an argument changed: reward 0)
    and two of the tiny model's own rollouts (reward 0), each scored by the
    environment. Returns the trajectories and the near misses' indices."""
    model = TrainablePolicy.load(folder, parse_args([], check_files=False).model, torch.device("cpu"),
                                 reference=False).model
    scripted = dataclasses.replace(ROLLOUT, max_new_tokens=4096)
    rollouts, near = [], []
    for g, entry in enumerate(study_entries):
        expert = play_script(entry, tokenizer, script_from_turns(expert_turns(entry)), scripted,
                             reward_token=HIGH_REWARD)
        near_miss = next(r for turns in near_misses(entry, seed=0)
                         if (r := play_script(entry, tokenizer, script_from_turns(turns), scripted,
                                              reward_token=LOW_REWARD)).reward == 0.0)
        sampled = run_episodes(HFEngine(model, tokenizer), tokenizer, [entry], group_size=2,
                               config=dataclasses.replace(ROLLOUT, seed=5 + g), reward_tokens=[LOW_REWARD] * 2)
        assert expert.reward == 1.0 and [r.reward for r in sampled] == [0.0, 0.0]  # the environment's verdicts
        near.append(len(rollouts) + 1)
        rollouts += [dataclasses.replace(r, group=g) for r in (expert, near_miss, *sampled)]
    return to_trajectories(rollouts), set(near)


def _ctx(tmp_path, tokenizer, folder, *flags):
    cfg = parse_args(["--out-dir", str(tmp_path), "--name", "direction", "--run.report_to", "none",
                      "--run.checkpoint_every", "0", "--run.micro_batch_tokens", "8192", *flags], check_files=False)
    return cfg, Run(cfg, torch.device("cpu"), tokenizer, folder)


def logps(ctx, policy, batch) -> torch.Tensor:
    """[N] log-prob of each generated token (0 elsewhere), eval mode, fp64."""
    policy.eval_mode()
    return trainer_logprobs(policy, batch, ctx.step_settings(), 1.0).double()


def per_sequence(values: torch.Tensor, batch) -> torch.Tensor:
    seq = rcgrpo_kernels.packing.sequence_ids(torch.arange(batch.num_tokens), batch.cu_seqlens)
    return torch.zeros(batch.num_seqs, dtype=torch.float64).index_add_(0, seq, values)


def random_adapters(policy, scale: float = 0.05) -> None:
    """Fresh adapters have B = 0: their first step moves B alone, and some
    rollouts' first-order change is then ~0 (two of the tiny model's rollouts
    moved by -0.003 nats whatever the advantage's sign: the second-order
    term). A random B stands for adapters that have trained."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    policy.equals_reference = False


@pytest.mark.slow  # eight RL updates of the tiny model on eight real ~2.3k-token sequences
@pytest.mark.parametrize("flipped", [False, True], ids=["rewards", "flipped"])
@pytest.mark.parametrize("path, mode", [("fused", "plain"), ("fused", "ppo_epochs"), ("fused", "lora"),
                                        ("fused", "verl_dialect"), ("reference", "plain")])
def test_an_rl_update_moves_each_rollout_with_its_advantage(tmp_path, tokenizer, tiny_folder, groups, path,
                                                            mode, flipped):
    """The expert and the model's own rollouts move in the sign of their
    advantage, and what the update maximises, J = sum_i A_i x (mean log p of
    i's generated tokens), rises.

    A near miss need not move with its advantage: it shares every token up
    to its divergent one with the expert, and over those shared tokens the
    group's advantages sum to the expert's sign (1.73 / the expert's length
    against 0.58 / the near miss's), so its shared part moves with the
    expert, here by more than its own part moves against it.

    Under LoRA the update lives in the adapters' low-rank span, where a
    rollout's change follows the tokens it shares with others: the tiny
    model's rollout with ",,,,,,,," (the expert writes ", " between calls)
    rose with the expert's positive advantage for some adapter inits. There
    the expert and the mean of the model's rollouts are held to the sign.

    ``verl_dialect``: the settings a verl user brings (RLOO advantages, the
    straight-through k3+ KL, dual clip, verl's clamps, seq-mean-token-sum)
    move every rollout the same way."""
    trajectories, near_misses_at = groups
    # The reference path builds [tokens, vocab] logits: micro-batches of one sequence keep that small.
    flags = (["--fused"] if path == "fused" else ["--run.micro_batch_tokens", "2560"]) + (LORA if mode == "lora" else [])
    cfg, ctx = _ctx(tmp_path, tokenizer, tiny_folder, *flags)
    torch.manual_seed(0)  # peft draws A from torch's generator
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=True)
    if mode == "lora":
        random_adapters(policy)
    trajectories = [dataclasses.replace(t, reward=1.0 - t.reward) if flipped else t for t in trajectories]
    batch = pack(trajectories)
    advantages = rcgrpo_kernels.group_advantages(batch.rewards, batch.seq_group)
    assert int((advantages > 0).sum()) == (6 if flipped else 2) and bool((advantages < 0).any())
    before = logps(ctx, policy, batch)
    optimizer, scheduler = make_optimizer(policy, 1e-3, 0.0, 2, 0.0)
    epochs = 2 if mode == "ppo_epochs" else 1
    settings, update = RLLossSettings(beta=0.1), UpdateSettings(updates_per_batch=epochs)
    if mode == "verl_dialect":
        settings = RLLossSettings(beta=0.1, loss_type="seq-mean-token-sum", kl_estimator="k3+", clip_ratio_c=3.0,
                                  log_ratio_clamp=20.0, kl_clamp=10.0)
        update = UpdateSettings(advantage_estimator="rloo")
    stats = rl_update(policy, trajectories, ctx.step_settings(), settings, update, optimizer=optimizer, scheduler=scheduler)
    assert stats["updates"] == epochs and stats["update_skipped"] == 0
    moved = per_sequence(logps(ctx, policy, batch) - before, batch)
    lengths = rcgrpo_kernels.packing.loss_token_counts(batch.loss_mask, batch.cu_seqlens).double()
    assert float((advantages.double() * moved / lengths).sum()) > 0, (moved, advantages)
    experts = torch.tensor([t.meta.get("reward_token") == HIGH_REWARD for t in trajectories])
    own = ~experts & torch.tensor([s not in near_misses_at for s in range(batch.num_seqs)])
    assert torch.all(torch.sign(moved[experts]) == torch.sign(advantages[experts])), (moved, advantages)
    if mode == "lora":
        assert torch.sign(moved[own].mean()) == torch.sign(advantages[own].mean()), (moved, advantages)
    else:
        assert torch.all(torch.sign(moved[own]) == torch.sign(advantages[own])), (moved, advantages)
    for s in near_misses_at:  # its shared part decides: it moves with its group's expert
        assert torch.sign(moved[s]) == torch.sign(advantages[s - 1]), (s, moved, advantages)


def _swap_tags(trajectory, ids):
    swap = {ids[HIGH_REWARD]: ids[LOW_REWARD], ids[LOW_REWARD]: ids[HIGH_REWARD]}
    return dataclasses.replace(trajectory, token_ids=[swap.get(t, t) for t in trajectory.token_ids])


@pytest.mark.slow  # 2 x 130 fine-tuning steps of the tiny model on two ~2.2k-token records (~60 s)
@pytest.mark.parametrize("swapped", [False, True], ids=["as_labelled", "tags_swapped"])
def test_rctp_teaches_the_high_tag_to_steer_the_first_divergent_token(tmp_path, tokenizer, tiny_folder,
                                                                      study_entries, swapped):
    """The tiny model learns the content of both records first (the steer
    stays ~0 while p(expert's token) is the same under both tags) and the
    condition after it, as the 135M model did in the pilots; 130 steps take
    it well past that turn (about step 90-110 here)."""
    from rcgrpo.model.loading import reward_token_ids

    cfg, ctx = _ctx(tmp_path, tokenizer, tiny_folder, "--fused", "--rctp.failure_source", "near_miss",
                    "--rctp.lr", "7e-3", "--rctp.batch_size", "2", "--rctp.epochs", "130", "--rctp.steer_every", "10")
    entry = [e for e in study_entries if e.id == "multi_turn_base_105"]
    records = build_rctp(None, entry, tokenizer, ROLLOUT, cfg.rctp, seed=0)
    (pair,) = divergences(records)  # measured as labelled: p(expert's token | high) vs | low)
    ids = reward_token_ids(tokenizer)
    trajectories = [_swap_tags(r.trajectory(), ids) if swapped else r.trajectory() for r in records]
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=False)
    steer_probe = SteerProbe([pair], ids[HIGH_REWARD], ids[LOW_REWARD], cfg.rctp.steer_every)
    finetune(ctx, "rctp", policy, trajectories, cfg.rctp, ctx.step_settings(), steer_probe)
    rows = [json.loads(x) for x in (tmp_path / "direction" / "metrics.jsonl").read_text().splitlines()]
    steer = {r["step"]: r["steer"] for r in rows if "steer" in r}
    assert sorted(steer) == list(range(0, 131, 10))
    assert abs(steer[0]) < 1e-3  # untrained: the tag changes nothing there
    if swapped:
        assert steer[130] < -1.0, steer
    else:
        assert steer[130] > 1.0, steer
    first = next(r for r in rows if r["step"] == 130)
    assert (first["p_expert_high"] > first["p_expert_low"]) is not swapped


# ------------------------------------------------------------------ a zero gradient makes no pass


def _zero_variance(groups):
    return [dataclasses.replace(t, reward=0.0) for t in groups[0]]


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_a_zero_variance_step_of_the_reference_policy_makes_no_pass(tmp_path, tokenizer, tiny_folder, groups, beta):
    cfg, ctx = _ctx(tmp_path, tokenizer, tiny_folder, "--fused")
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=beta > 0)
    optimizer, scheduler = make_optimizer(policy, 1e-3, 0.0, 2, 0.0)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    passes = []
    hook = policy.model.register_forward_hook(lambda *_: passes.append(1))
    try:
        stats = rl_update(policy, _zero_variance(groups), ctx.step_settings(), RLLossSettings(beta=beta), UpdateSettings(),
                          optimizer=optimizer, scheduler=scheduler)
    finally:
        hook.remove()
    assert stats["update_skipped"] == 1 and stats["updates"] == 0 and "loss" not in stats
    assert passes == [] and scheduler.last_epoch == 0
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in policy.model.named_parameters())


def test_after_an_update_a_zero_variance_step_keeps_its_kl_gradient(tmp_path, tokenizer, tiny_folder, groups):
    cfg, ctx = _ctx(tmp_path, tokenizer, tiny_folder, "--fused")
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=True)
    optimizer, scheduler = make_optimizer(policy, 1e-3, 0.0, 2, 0.0)
    settings = RLLossSettings(beta=0.1)
    first = rl_update(policy, groups[0], ctx.step_settings(), settings, UpdateSettings(), optimizer=optimizer, scheduler=scheduler)
    assert first["updates"] == 1 and first.get("kl", 0.0) == pytest.approx(0.0, abs=1e-7)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    second = rl_update(policy, _zero_variance(groups), ctx.step_settings(), settings, UpdateSettings(), optimizer=optimizer,
                       scheduler=scheduler)
    assert second["update_skipped"] == 0 and second["updates"] == 1 and second["kl"] > 0
    assert second["grad_norm"] > 0 and second["adv_abs_mean"] == 0.0
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())


# ------------------------------------------------------------------ the steer probe and dropout


@pytest.mark.slow  # builds RCTP pairs and forwards each under both tags (~2 s)
def test_the_steer_is_the_experts_token_log_prob_under_each_tag(tokenizer, tiny_folder, study_entries):
    """The probe (prefix sharing, packed) equals a plain forward of each
    pair's prefix under each tag; swapping the tags negates it."""
    from rcgrpo.model.loading import reward_token_ids
    from rcgrpo.training.steer import steer

    records = build_rctp(None, study_entries, tokenizer, ROLLOUT,
                         parse_args(["--rctp.failure_source", "near_miss"], check_files=False).rctp, seed=0)
    pairs = divergences(records)
    assert len(pairs) == 2
    policy = TrainablePolicy.load(tiny_folder, parse_args([], check_files=False).model, torch.device("cpu"),
                                  reference=False)
    ids = reward_token_ids(tokenizer)
    high, low = ids[HIGH_REWARD], ids[LOW_REWARD]
    with torch.no_grad():  # rows far apart, so that the tag matters
        emb = policy.model.get_input_embeddings().weight
        emb[high] += 30.0 * torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(1))
    policy.eval_mode()
    out = steer(policy.lm, pairs, high, low, micro_batch_tokens=8192)
    plain = []
    with torch.no_grad():
        for d in pairs:
            logp = {}
            for tag in (high, low):
                prefix = list(d.prefix)
                prefix[d.tag_at] = tag
                logits = policy.model(input_ids=torch.tensor([prefix])).logits[0, -1]
                logp[tag] = float(logits.float().log_softmax(-1)[d.expert_token])
            plain.append(logp)
    expected = sum(p[high] - p[low] for p in plain) / len(plain)
    assert abs(expected) > 1e-3 and out["steer"] == pytest.approx(expected, abs=1e-5)
    assert out["p_expert_high"] == pytest.approx(sum(math.exp(p[high]) for p in plain) / 2, rel=1e-4)
    assert out["p_expert_low"] == pytest.approx(sum(math.exp(p[low]) for p in plain) / 2, rel=1e-4)
    assert out["steer_pairs"] == 2
    swapped = steer(policy.lm, pairs, low, high, micro_batch_tokens=8192)
    assert swapped["steer"] == pytest.approx(-out["steer"], abs=1e-5)
    assert steer(policy.lm, [], high, low, micro_batch_tokens=8192) == {}


@pytest.mark.slow  # two PPO passes of the tiny model under LoRA (~10 s)
def test_ppo_epochs_under_lora_dropout_start_at_ratio_one(tmp_path, tokenizer, tiny_folder, groups):
    """RL passes run with dropout off: the old log-probs and the first pass
    score the same deterministic policy, so nothing is clipped before the
    first optimizer step, whatever LoRA's dropout (0.5 here)."""
    trajectories, _ = groups
    lora = [x if x != "0.05" else "0.5" for x in LORA]
    cfg, ctx = _ctx(tmp_path, tokenizer, tiny_folder, "--fused", *lora)
    assert cfg.model.lora.dropout == 0.5
    torch.manual_seed(0)
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=True)
    random_adapters(policy, scale=0.5)  # adapters that matter, so that dropout on them would show
    optimizer, scheduler = make_optimizer(policy, 1e-3, 0.0, 2, 0.0)
    stats = rl_update(policy, trajectories, ctx.step_settings(), RLLossSettings(beta=0.0), UpdateSettings(updates_per_batch=2),
                      optimizer=optimizer, scheduler=scheduler)
    assert stats["updates"] == 2 and stats["clip_frac_pass1"] == 0.0
