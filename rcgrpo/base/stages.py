"""The stages a run is made of and the pipelines that order them: the one
home of their names (no imports, so that every module can take them)."""

FINETUNE_STAGES = ("sft", "rctp")  # supervised: SFT on expert data, RCTP on reward-tagged data
RL_STAGES = ("grpo", "rc-grpo")
TRAINED_STAGES = FINETUNE_STAGES + RL_STAGES  # each leaves a models/<stage> folder
ENGINE_STAGES = ("rctp-data", "eval")  # only the engine runs: rollouts, no training

# Each pipeline is a row of the paper's Table 1/3 (arXiv 2602.03025); its
# stages run in order and each reads the previous one's checkpoint.
# "rctp-data" builds the labelled expert + failure trajectories; "sft" builds
# its expert-only data itself.
PIPELINES: dict[str, tuple[str, ...]] = {
    "rctp+rc-grpo": ("rctp-data", "rctp", "rc-grpo", "eval"),
    "rctp+grpo": ("rctp-data", "rctp", "grpo", "eval"),
    "sft+grpo": ("sft", "grpo", "eval"),
    "sft+rc-grpo": ("sft", "rc-grpo", "eval"),
    # Not in the paper: DAPO's dynamic sampling (zero-variance groups dropped,
    # more prompts drawn) as the competing remedy for vanishing advantages.
    "sft+grpo-ds": ("sft", "grpo", "eval"),
}
# Pipelines whose GRPO stage runs with dynamic sampling (grpo.dynamic_sampling none = on).
DYNAMIC_SAMPLING_PIPELINES = ("sft+grpo-ds",)
# The paper's RL batch differs between the methods (its hyper-parameter table).
PAPER_RL_BATCH = {"rc-grpo": 256, "grpo": 64}
