"""The tree parity oracle (rcgrpo.training.parity) on a tiny model and real
BFCL prompts: the shared-prefix forward agrees with the dense one within the
bound (sdpa and eager, fp32 and bf16 autocast); a fine-tuning stage checks
once by default (every N steps when asked, never with sharing off) and logs
the figure at its step; a tree broken on purpose is refused in one line
before the step applies anything, and what was saved stays. The RL stage's
check is asserted in tests/training/test_rl_step.py (the agreement test)."""
import json

import pytest
import torch

from rcgrpo.base.errors import UserError, one_line
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.config import parse_args
from rcgrpo.model import prefix_sharing
from rcgrpo.model.packing import Trajectory, pack
from rcgrpo.model.policy import PackedLM, TrainablePolicy
from rcgrpo.model.prefix_sharing import common_prefix_length, with_prefix_layout
from rcgrpo.pipeline.run import Run
from rcgrpo.run.checkpoint import load_latest
from rcgrpo.training.finetune import finetune
from rcgrpo.training.losses import LOSS_PATHS
from rcgrpo.training.parity import (
    PARITY_METRICS,
    PARITY_PREFIX,
    PARITY_TAIL,
    TreeParityError,
    parity_bound,
    parity_sample,
    shares_a_prefix,
    tree_vs_dense,
)

PROMPT_TAIL = 256  # prompt tokens kept (the tag is at its end): eager's dense [N, N] mask stays small


@pytest.fixture(scope="module")
def group(tokenizer, entries):
    """An RC-GRPO-shaped group of a real BFCL entry: its first prompt under
    each reward token, each with the expert's first reply and a failure: a
    tree three levels deep (the prompt, the tag, the reply)."""
    from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
    from rcgrpo.data.expert import expert_turns, script_from_turns
    from rcgrpo.envs.bfcl import Episode

    chat = ChatTokens(tokenizer)
    entry = next(e for e in entries if e.category == "base")
    replies = [script_from_turns(expert_turns(entry))[0], "I cannot help with that."]
    out = []
    for token in (HIGH_REWARD, LOW_REWARD):
        prompt = chat.prompt_ids(initial_messages(Episode(entry), token, "compact"))[-PROMPT_TAIL:]
        for k, text in enumerate(replies):
            reply = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [chat.eot_id]
            out.append(Trajectory(prompt + reply, [0] * len(prompt) + [1] * len(reply), group=0, reward=1.0 - k))
    return out


def _policy(folder, *flags):
    cfg = parse_args(list(flags), check_files=False)
    return TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=False)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tree_forward_equals_the_dense_one_within_the_bound(tiny_folder, group, attn, dtype):
    policy = _policy(tiny_folder, "--model.attn_implementation", attn, "--model.dtype", dtype)
    policy.eval_mode()
    batch = pack(group)
    assert shares_a_prefix(batch) and policy.lm.shares_prefixes
    diff = tree_vs_dense(policy.lm, batch, LOSS_PATHS["fused"])
    assert diff.numel() == batch.num_loss_tokens > 0
    bound, precision = parity_bound(policy.compute_dtype)
    assert precision == dtype and float(diff.max()) <= bound, float(diff.max())


def test_the_check_samples_a_window_where_a_branch_leaves_its_root(group):
    """The sample: the batch's first branch and its root, each cut to the
    last PARITY_PREFIX tokens of the prefix they share and PARITY_TAIL after
    it, the tails scored; its tree forward still shares the window's prefix."""
    batch = with_prefix_layout(pack(group))
    sample = parity_sample(batch)
    ids, cu = batch.input_ids, batch.cu_seqlens.tolist()
    a, b = 0, next(s for s, root in enumerate(batch.prefix_layout.seq_root) if root != s)
    shared = common_prefix_length(ids[cu[a]:cu[a + 1]], ids[cu[b]:cu[b + 1]])
    assert shared > PARITY_PREFIX  # the group's prompt: the window is cut from it
    start = shared - PARITY_PREFIX
    windows = [ids[cu[s] + start:min(cu[s] + shared + PARITY_TAIL, cu[s + 1])] for s in (a, b)]
    assert torch.equal(sample.input_ids, torch.cat(windows)) and sample.seq_lens == [len(w) for w in windows]
    assert sample.num_loss_tokens == sample.num_tokens - 2 * PARITY_PREFIX > 0 and shares_a_prefix(sample)
    # A batch whose sequences read no prefix of another is checked whole.
    alone = pack(group[:1])
    assert parity_sample(alone) is alone


def test_a_tree_one_key_short_is_refused_at_the_first_step(tmp_path, tokenizer, tiny_folder, group, monkeypatch):
    """The planted bug the bound is sized against (benchmarks/tree_parity.py:
    every branch one key short of its prefix) is caught on the sample. Under
    eager attention: it reads the layout's mask as given (tree attention's
    plan refuses such a layout before any forward)."""
    from benchmarks.tree_parity import one_key_short

    ctx, policy = _run(tmp_path, tokenizer, tiny_folder, group, "--rctp.epochs", "1",
                       "--model.attn_implementation", "eager")
    built = prefix_sharing.shared_prefix_layout
    monkeypatch.setattr(prefix_sharing, "shared_prefix_layout",
                        lambda b, **kw: one_key_short(built(b, **kw)) if kw.get("share", True) else built(b, **kw))
    with pytest.raises(TreeParityError, match=r"^\[rctp\] step 1: the tree \(shared-prefix\) forward disagrees"):
        finetune(ctx, "rctp", policy, group, ctx.cfg.rctp, ctx.step_settings())


def _run(tmp_path, tokenizer, tiny_folder, group, *flags):
    cfg = parse_args(["--fused", "--out-dir", str(tmp_path), "--name", "p", "--run.report_to", "none",
                      "--run.checkpoint_every", "0", "--rctp.batch_size", "4", "--rctp.lr", "1e-3", *flags],
                     check_files=False)
    ctx = Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)
    return ctx, TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=False)


def _rows(tmp_path):
    return [json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("share,every,steps,checked", [(True, 0, 2, [1]), (True, 2, 3, [1, 2]), (False, 0, 1, [])],
                         ids=["default", "every_2", "sharing_off"])
def test_a_stage_checks_once_by_default_every_n_steps_when_asked(tmp_path, tokenizer, tiny_folder, group, capsys,
                                                                  monkeypatch, share, every, steps, checked):
    """The dense forward runs exactly at the checked steps (not every step),
    and each check's figures and cost land in metrics.jsonl at its step; with
    sharing off nothing is checked and the stage says so once."""
    ctx, policy = _run(tmp_path, tokenizer, tiny_folder, group, "--rctp.epochs", str(steps),
                       "--model.share_prefixes", str(share).lower(), "--model.parity_check_every", str(every))
    dense_passes = []
    forward = PackedLM.hidden_states

    def counting(lm, batch):
        if share and not lm.shares_prefixes:
            dense_passes.append(1)
        return forward(lm, batch)

    monkeypatch.setattr(PackedLM, "hidden_states", counting)
    finetune(ctx, "rctp", policy, group, ctx.cfg.rctp, ctx.step_settings())
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["step"] for r in rows if "tree_parity_max_abs" in r] == checked
    assert len(dense_passes) == len(checked)
    for r in rows:
        if r["step"] in checked:
            assert set(PARITY_METRICS) <= r.keys()
            assert 0 <= r["tree_parity_mean_abs"] <= r["tree_parity_max_abs"] <= r["tree_parity_bound"] == 1e-3
            # The check's sample: one branch and its root, not the whole micro-batch.
            assert 0 < r["tree_parity_tokens"] < sum(t.sampled_mask.count(1) for t in group) and r["tree_parity_s"] > 0
    err = capsys.readouterr().err
    assert err.count("tree parity at step") == len(checked)
    assert err.count("tree parity: not checked") == (0 if share else 1)
    # The stage's last line says what the checks found and cost.
    assert ("tree parity max " in err and f"({len(checked)} check" in err) is bool(checked)


def test_a_broken_tree_is_refused_in_one_line_and_nothing_saved_is_lost(tmp_path, tokenizer, tiny_folder, group,
                                                                         monkeypatch):
    """Checked at steps 1 and 2; the tree forward breaks after step 1 was
    saved: step 2 is refused before its pass, with the figures, and step 1's
    checkpoint, metrics and weights are what they were."""
    ctx, policy = _run(tmp_path, tokenizer, tiny_folder, group, "--rctp.epochs", "2",
                       "--model.parity_check_every", "2", "--run.checkpoint_every", "1")
    broken, saved = [], {}
    forward = PackedLM.hidden_states

    def perturbed(lm, batch):
        hidden = forward(lm, batch)
        if broken and lm.shares_prefixes:  # the tree forward only: rows of the last sequence moved
            hidden = hidden.clone()
            hidden[int(batch.cu_seqlens[-2]):] += 0.5
        return hidden

    def save_then_break(*args, **kwargs):
        Run.save(ctx, *args, **kwargs)
        saved.update({n: p.detach().clone() for n, p in policy.model.named_parameters()})
        broken.append(1)

    monkeypatch.setattr(PackedLM, "hidden_states", perturbed)
    ctx.save = save_then_break
    with pytest.raises(TreeParityError) as caught:
        finetune(ctx, "rctp", policy, group, ctx.cfg.rctp, ctx.step_settings())
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and one_line(caught.value) == message
    assert message.startswith("[rctp] step 2: the tree (shared-prefix) forward disagrees with the dense forward: "
                              "max |log p tree - log p dense| ")
    assert "above the float32 bound 0.001" in message and "--model.share_prefixes false" in message
    figure = float(message.split("dense| ")[1].split(" nats")[0])
    assert figure > 0.01
    (row,) = _rows(tmp_path)
    assert row["step"] == 1 and row["tree_parity_max_abs"] <= 1e-3
    assert load_latest(ctx.checkpoint_root("rctp")).step == 1
    assert all(torch.equal(p, saved[n]) for n, p in policy.model.named_parameters())
