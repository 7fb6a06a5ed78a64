"""The training stages' updates, from trajectories to new weights.

Supervised fine-tuning (SFT / RCTP):

* ``finetune``: the stage (``finetune(ctx, stage, policy, trajectories,
  section, steer_pairs=..., steer_every=...)``), one step at a time
  (``sft_step``); ``steer``: RCTP's steer probe.

GRPO / RC-GRPO:

* ``rl_loop``: the stage (``train_rl(ctx, stage, policy, engine, entries,
  finetune_stage=...)``): the prompt schedule, each step's rollouts, its
  update and its record.
* ``rl_update``: one update from one step's trajectories (group advantages,
  mini-batches, gradient accumulation over micro-batches, optimizer steps):
  ``rl_update``, the one the loop and the tests call.
* ``dynamic_sampling``: DAPO's kept groups and extra draws.
* ``agreement``: engine vs trainer log-probs, truncated importance sampling.
* ``rl_statistics``: the step's reward and advantage summaries.
* ``reward_probe``: the stage's learning curve (sampled reward).

Shared by both: ``losses`` (the loss paths by name, "fused" / "reference",
and the losses), ``optimizer``, ``lockstep`` (equal pass counts across
ranks), ``parity`` (the tree parity oracle), ``stage_verdict`` (the bar and
the closing line), ``context`` (what a run's stages share) and
``memory_plan`` (whether a stage fits the device, before the run).

May import: ``rcgrpo.base``, ``rcgrpo.envs``, ``rcgrpo.conditioning``,
``rcgrpo.run``, ``rcgrpo.model``, ``rcgrpo.rollout``, ``rcgrpo.config``,
``rcgrpo.data``, ``rcgrpo.evaluation`` and ``rcgrpo_kernels``.

Nothing is imported here: ``memory_plan`` is read before any model loads
(import the stages from their modules).
"""
