"""Each stage's rollout settings come from one place
(rcgrpo.training.rollout_settings.rollout_settings): the values each stage built
for itself before, every one of them a different number here so that a
setting read from the wrong section shows."""
from rcgrpo.config import parse_args
from rcgrpo.rollout.agent_loop import RolloutConfig
from rcgrpo.training.rollout_settings import rollout_settings

FLAGS = ["--grpo.max_new_tokens", "55", "--grpo.max_total_tokens", "9999", "--grpo.temperature", "0.7",
         "--grpo.top_p", "0.9", "--rctp.failure_temperature", "1.3", "--eval.max_new_tokens", "77",
         "--data.seed", "3", "--data.doc_style", "official"]


def test_rctp_data_and_sft_read_the_failure_temperature_and_the_rl_budgets():
    cfg = parse_args(FLAGS, check_files=False)
    want = RolloutConfig(max_new_tokens=55, max_total_tokens=9999, temperature=1.3, seed=3, doc_style="official",
                         progress=True)
    assert rollout_settings(cfg, "rctp-data") == rollout_settings(cfg, "sft") == want


def test_an_rl_stage_samples_at_its_temperature_and_top_p_and_takes_each_calls_seed():
    cfg = parse_args(FLAGS, check_files=False)
    for stage in ("grpo", "rc-grpo"):
        assert rollout_settings(cfg, stage, seed=11, policy_version=2) == RolloutConfig(
            max_new_tokens=55, max_total_tokens=9999, temperature=0.7, top_p=0.9, seed=11, doc_style="official",
            progress=False, policy_version=2)


def test_eval_is_greedy_unless_told_to_sample_at_the_rl_temperature():
    greedy = rollout_settings(parse_args(FLAGS, check_files=False), "eval")
    assert greedy == RolloutConfig(max_new_tokens=77, max_total_tokens=9999, temperature=0.0, seed=3,
                                   doc_style="official")
    sampled = rollout_settings(parse_args([*FLAGS, "--eval.greedy", "false"], check_files=False), "eval")
    assert sampled.temperature == 0.7 and sampled.max_new_tokens == 77
