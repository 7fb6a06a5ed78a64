"""`python -m rcgrpo.train`: the RCTP -> RC-GRPO pipeline.

Not built yet: the trainer lands with its own issue (RCTP data, RCTP/SFT
fine-tuning, GRPO/RC-GRPO, checkpoints, report). Until then this entry point
says so and exits non-zero instead of pretending to train.
"""
import sys

MISSING = """rcgrpo.train: the trainer is not implemented yet.
What exists today:
  - the BFCL v4 multi-turn environment and official scoring: python -m rcgrpo.eval --ground-truth
What is missing before `--fused` training can run:
  - the trainer (RCTP data + fine-tuning, GRPO / RC-GRPO, checkpoints, report)
See README.md ("What works today")."""


def main(argv=None) -> int:
    print(MISSING, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
