"""What a rollout is conditioned on: the reward tokens and the rules that
pick one per prompt (``reward_tokens``), and the chat prompt a BFCL entry
becomes, with the token appended to the first user message (``prompts``).

May import: ``rcgrpo.base`` and ``rcgrpo.envs``.
"""
