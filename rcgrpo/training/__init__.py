"""Training stages: supervised fine-tuning (SFT / RCTP) and GRPO / RC-GRPO."""
