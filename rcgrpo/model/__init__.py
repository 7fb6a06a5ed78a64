"""The policy: loading a model with the reward tokens (``loading``), its
shapes read without loading it (``shape``), hub ids (``hub``), LoRA
(``lora``), packing sequences into rows (``packing``), cutting a packed
batch into micro-batches (``micro_batching``), shared prefixes and tree
attention (``prefix_sharing``, ``tree_attention``, ``attention``), the
trainable policy and its sharded state (``policy``, ``sharded_state``) and
adapters others can load (``sharing``).

May import: ``rcgrpo.base``, ``rcgrpo.envs``, ``rcgrpo.conditioning``,
``rcgrpo.run`` and ``rcgrpo_kernels``.
"""
