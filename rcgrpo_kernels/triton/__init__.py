"""Triton kernels, one file per kernel family.

- ``logprob``: token log-probs from logits (online logsumexp over vocab blocks)
- ``fused_linear_logprob``: token log-probs from hidden states and the lm_head
  weight, tiled over tokens and vocab; the [N, V] logits are never written
- ``advantage``: group-normalised advantages in one launch
- ``loss``: the clipped GRPO objective over per-token log-probs
- ``fused_linear_grpo_loss``: all of the above in one pass over the loss tokens

Imported lazily by ``rcgrpo_kernels.dispatch`` so that ``import rcgrpo_kernels`` needs
neither a GPU nor Triton. To run these kernels on CPU tensors set
``TRITON_INTERPRET=1`` before the first kernel module is imported.
"""
