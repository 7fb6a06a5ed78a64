"""Trainer steps on the real model and engine: one RCTP step and one RC-GRPO
step change the weights and, after the in-place swap, the engine's output;
the fused and reference losses agree on a real BFCL batch; the drawn reward
token reaches each rollout's prompt."""
import dataclasses

import pytest
import torch

import rcgrpo_kernels
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD, DrawPerRollout
from rcgrpo.config import parse_args
from rcgrpo.data.expert import expert_turns, play_script, script_from_turns
from rcgrpo.model.loading import reward_token_ids
from rcgrpo.model.packing import pack
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.pipeline.run import Run
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.rollout.engine import SamplingConfig
from rcgrpo.training.finetune import finetune
from rcgrpo.training.losses import LOSS_PATHS, RLLossSettings, reference_logprobs, rl_loss, sft_loss
from rcgrpo.training.optimizer import clip_and_step, make_optimizer
from rcgrpo.training.rl_update import UpdateSettings, rl_update, to_trajectories
from tests.training.conftest import chat_record

ROLLOUT = RolloutConfig(max_new_tokens=16, max_total_tokens=6144, doc_style="compact_no_response",
                        progress=False, seed=3)


@pytest.fixture(scope="module")
def short_entry(entries, tokenizer):
    from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
    from rcgrpo.envs.bfcl import Episode

    chat = ChatTokens(tokenizer)
    base = [e for e in entries if e.category == "base"][:40]
    return min(base, key=lambda e: len(chat.prompt_ids(initial_messages(Episode(e), None, "compact_no_response"))))


@pytest.fixture(scope="module")
def real_group(vllm_engine, tokenizer, short_entry):
    """One group of a real RC-GRPO batch: the scripted expert (reward 1) and a
    model rollout conditioned on a drawn token, both on the same entry."""
    expert = play_script(short_entry, tokenizer, script_from_turns(expert_turns(short_entry)),
                         dataclasses.replace(ROLLOUT, max_new_tokens=1024), reward_token=HIGH_REWARD)
    (sampled,) = run_episodes(vllm_engine, tokenizer, [short_entry], group_size=1, config=ROLLOUT,
                              reward_tokens=[LOW_REWARD])
    assert expert.reward == 1.0
    return [expert, sampled]


def greedy(engine, ids):
    """Greedy tokens and their log-probs: any weight change moves the latter."""
    g = engine.generate([ids], SamplingConfig(temperature=0.0, max_tokens=12))[0][0]
    return g.token_ids, g.logprobs


def moved(a, b) -> bool:
    return a[0] != b[0] or max(abs(x - y) for x, y in zip(a[1], b[1])) > 1e-4


def test_reward_tokens_reach_each_rollouts_prompt_as_drawn(vllm_engine, tokenizer, short_entry):
    ids = reward_token_ids(tokenizer)
    rollouts = run_episodes(vllm_engine, tokenizer, [short_entry], group_size=4,
                            config=dataclasses.replace(ROLLOUT, max_new_tokens=4, seed=11),
                            reward_tokens=DrawPerRollout(p_high=0.5))
    drawn = [r.reward_token for r in rollouts]
    assert set(drawn) <= {HIGH_REWARD, LOW_REWARD}
    for r in rollouts:
        prompt = r.token_ids[: r.prompt_len]
        assert prompt.count(ids[r.reward_token]) == 1
        other = LOW_REWARD if r.reward_token == HIGH_REWARD else HIGH_REWARD
        assert ids[other] not in r.token_ids


def test_fused_and_reference_losses_agree_on_a_real_batch(policy, real_group):
    # The session model as its own reference: one decoder pass, the paths differ after it.
    trained = TrainablePolicy(policy.model, reference=policy.model)
    lm = trained.lm
    batch = pack(to_trajectories(real_group))
    batch = dataclasses.replace(batch, advantages=rcgrpo_kernels.group_advantages(batch.rewards, batch.seq_group))
    with torch.no_grad():
        hidden = lm.hidden_states(batch)
        ref = reference_logprobs(trained, batch, LOSS_PATHS["fused"], temperature=1.0, hidden=hidden)
        ref_slow = reference_logprobs(trained, batch, LOSS_PATHS["reference"], temperature=1.0, hidden=hidden)
        torch.testing.assert_close(ref, ref_slow, atol=2e-4, rtol=1e-4)
        batch = dataclasses.replace(batch, ref_logp=ref - 0.01 * batch.loss_mask)  # non-zero KL
        settings = RLLossSettings(beta=0.1)
        fused, fs = rl_loss(lm, batch, settings, LOSS_PATHS["fused"], hidden=hidden)
        plain, ps = rl_loss(lm, batch, settings, LOSS_PATHS["reference"], hidden=hidden)
        nll_f, _ = sft_loss(lm, batch, LOSS_PATHS["fused"], hidden=hidden)
        nll_p, _ = sft_loss(lm, batch, LOSS_PATHS["reference"], hidden=hidden)
    assert batch.num_loss_tokens > 0 and float(batch.advantages.abs().sum()) > 0
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fs["kl"], ps["kl"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fs["entropy"], ps["entropy"], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(nll_f, nll_p, atol=1e-4, rtol=1e-4)


def test_one_rctp_and_one_rcgrpo_step_change_weights_and_engine_output(
        policy, vllm_engine, tokenizer, chat_ids, real_group, tmp_path, capsys):
    cfg = parse_args(["--fused", "--out-dir", str(tmp_path), "--name", "steps", "--run.checkpoint_every", "0",
                      "--rctp.lr", "1e-4", "--rctp.batch_size", "4", "--rctp.epochs", "1",
                      "--run.report_to", "none"])
    ctx = Run(cfg, torch.device("cpu"), tokenizer, policy.path)
    # Fresh copies (the session policy stays as it is), loaded as a stage loads them.
    trained = TrainablePolicy.load(policy.path, cfg.model, torch.device("cpu"), reference=False)
    model = trained.model
    probe = chat_ids("List the files in the current directory.")
    original = greedy(vllm_engine, probe)
    try:
        # RCTP: one optimizer step on reward-tagged conversations
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        records = [chat_record(tokenizer, f"List files {i}", "[ls(a=True)]", HIGH_REWARD, 1.0) for i in range(4)]
        finetune(ctx, "rctp", trained, [r.trajectory() for r in records], cfg.rctp, ctx.step_settings())
        err = capsys.readouterr().err
        assert "rctp: 100%" in err and "loss=" in err and "[rctp] done: 1 step; loss " in err
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, start[n])]
        assert "model.embed_tokens.weight" in changed and len(changed) > 100
        vllm_engine.load_weights(trained.rollout_weights())
        after_rctp = greedy(vllm_engine, probe)
        assert moved(after_rctp, original)

        # RC-GRPO: one update on a real group with reward variance, through
        # the trainer's own update (token-balanced micro-batches; the KL term
        # is tested beside it, on the same batch)
        optimizer, scheduler = make_optimizer(trained, 1e-4, 0.0, 1, 0.0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trained.train_mode()
        stats = rl_update(trained, to_trajectories(real_group), ctx.step_settings(), RLLossSettings(beta=0.0), UpdateSettings("group"))
        grad_norm = clip_and_step(trained, optimizer, scheduler, 1.0)
        trained.eval_mode()
        assert grad_norm > 0 and stats["adv_abs_mean"] > 0 and stats["loss_tokens"] > 0
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
        vllm_engine.load_weights(trained.rollout_weights())
        assert moved(greedy(vllm_engine, probe), after_rctp)
    finally:
        vllm_engine.load_weights(policy.model.named_parameters())  # the engine is shared
    assert not moved(greedy(vllm_engine, probe), original)
