"""Will a training stage fit the device? A pure estimate, made before any model loads.

`plan_stage` adds up what one stage needs per rank, phase by phase, from the
model's shapes (`ModelShape`: a config.json, optionally with the exact
parameter count from the safetensors headers) and the run's settings;
`check_stage` raises `MemoryPlanError`, one line naming the stage, needed vs
available GiB per rank, the biggest items, and the ways out that would help,
each re-estimated (``rcgrpo.training.memory_ways_out``: LoRA, more ranks,
gradient checkpointing, shorter micro-batches, ...). Nothing here loads a
model or allocates a tensor. The model's shapes come from
``rcgrpo.model.shape``, the device's and host's memory from
``rcgrpo.base.host``.

Precision rules of the trainer (what the estimate assumes)
-----------------------------------------------------------
P = parameters, c = bytes of the compute dtype ``model.dtype`` (float32 4,
bfloat16/float16 2), W = world size (torchrun ranks; FSDP2 when W > 1).

* Full fine-tuning: fp32 master weights (4 B/param), fp32 gradients (4 B),
  AdamW exp_avg + exp_avg_sq fp32 (8 B); all three sharded over W under FSDP2.
  The matmuls run in the compute dtype. One process with bf16/fp16 runs under
  autocast, which keeps a compute-dtype copy of every weight alive through
  backward (+c B/param, not sharded). Under FSDP2 only the layers in flight are
  unsharded in the compute dtype: the root (embeddings + LM head + final norm)
  plus two decoder layers (counted for float32 compute too: the all-gather
  buffers).
* LoRA (``model.lora.enabled``, one process only): the frozen base is held in
  the compute dtype (c B/param, no autocast copy of it). Adapter parameters,
  r x (in + out) per targeted Linear per layer (``model.lora.target_modules``;
  "all-linear" = the seven projections, ``rcgrpo.model.shape.LAYER_PROJECTIONS``),
  plus the two trainable reward-token rows (2 x hidden), are fp32 with fp32
  gradients and AdamW state: 16 B/param.
  The KL reference is the same model with its adapters off: no extra copy.
* RL stages ("grpo", "rc-grpo") with ``grpo.beta > 0`` and full fine-tuning
  hold a frozen reference that computes exactly as the policy did at step 0:
  in one process under autocast, the decoder's Linear weights in the compute
  dtype (what autocast casts the policy's fp32 weights to) and the root
  (embeddings, LM head, norms; counted as the root) in fp32; under FSDP2 all
  in the compute dtype, sharded (its mixed-precision policy casts every
  parameter of the policy).
  Fine-tuning stages ("sft", "rctp") hold none.
* Activations, per micro-batch of T tokens: T = max(run.micro_batch_tokens,
  grpo.max_total_tokens) for RL stages (a trajectory longer than a micro-batch
  gets a micro-batch of its own), T = run.micro_batch_tokens for fine-tuning
  (longer trajectories are ignored). ROUGH, for a Llama-style layer with
  flash/varlen attention (no T^2 term), bytes per token per layer::

      4 r H                                 two RMSNorms: input + normalised output
      + c (2 H + 3 q + 2 kv + 4 I)          q/k/v and MLP inputs, q, k, v, attention
                                            output (+ its o_proj copy), gate, up,
                                            silu(gate), silu(gate) * up
      + LoRA with dropout: (c + 1) x the in-features of every adapted Linear
                                            (dropout's copy of the input + its mask)

  with H = hidden, I = intermediate, q = heads x head_dim, kv = kv heads x
  head_dim, r = bytes of the residual stream (4 under autocast with fp32
  weights, c when the weights are held in the compute dtype: LoRA's base).
  With ``model.gradient_checkpointing``: the saved layer inputs (layers x T x H
  x r) plus one layer's activations (recomputed in backward); without: every
  layer's. The loss: the fused path (``run.fused``) never builds T x vocab
  logits, only chunks (2 x min(256 rows x vocab x 4 B, 256 MiB):
  ``rcgrpo_kernels.chunked``'s CHUNK_ROWS and CHUNK_BYTES); the plain path
  builds fp32 logits and their gradient, 2 x T x vocab x 4 B. Plus two
  fp32 T x H buffers (final norm, hidden-state gradient).
* The rollout engine (vLLM, in-process; ``run.engine`` "auto" is taken to be
  vLLM, the bigger case): on CUDA it takes ``run.engine_memory_fraction`` of the
  device while awake and sleeps during updates (level 1; counted as 1 GiB left:
  CUDA graphs, workspaces); on CPU it holds fp32 weights (4 B/param) all the
  time and its 2 GiB KV cache (``rcgrpo.rollout.vllm_engine.CPU_KV_CACHE_GIB``)
  while awake (asleep, the cache's memory is released: ``VLLMEngine.sleep``).
  The transformers engine ("hf") loads its own fp32 copy on the host: 4
  B/param on CPU, nothing on a GPU.
* Rollouts, RL stages: a step's rollouts are all held on the host at once
  (the engine plays them together; their ids, masks and log-probs are Python
  lists, then the update's trajectories): grpo.batch_size x grpo.group_size of
  them per engine group (the batch's prompts are split over world size /
  run.engine_tp_size engine groups; twice that with dynamic sampling, whose
  scheduled groups are kept beside the kept ones), each up to
  grpo.max_total_tokens tokens of ~96 B (measured ~77 B: a Python int id, a
  mask int, a log-prob float, a version per token, plus the lists' growth).
  On CPU that is part of both phases; on CUDA it is checked against the
  host's memory (``host_bytes``), shared by the node's ranks. "rctp-data"
  with rollout failures likewise holds every training entry's
  rctp.failure_attempts rollouts at once (``rctp_entries`` x attempts);
  the sampled-reward probe (grpo.eval_rollouts, every grpo.eval_every steps)
  holds its rollouts at once between steps: the larger count is planned.
* Two phases per RL step, the peak is the larger: rollout = weights + optimizer
  state + reference + engine awake (gradients freed); update = weights +
  gradients + optimizer state + reference + activations + autocast copies +
  engine asleep. Fine-tuning stages: the update phase (plus the engine asleep
  when one is alive, ``engine_alive``). "rctp-data" and "eval" only run the
  engine (eval also loads the fp32 policy on the host to hand its weights over).
* Safety margin on the peak: 1 GiB + 5% (CUDA context, allocator
  fragmentation; on CPU the interpreter and libraries).
* Disk (``rcgrpo.base.host.check_disk``): a file the run must write before
  it can start, the token-extended copy of a model without the reward tokens
  (rcgrpo.model.loading: as large as the model's safetensors, + 5%), is
  refused when its disk has less free space, before it is written.
* On CUDA each rank has its own device: the per-rank need is compared with the
  device's total memory. On CPU the ranks of a node share the host: the
  per-rank need x the local world size is compared with the host's memory.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import rcgrpo.base.host as _host_module
import rcgrpo.model.shape as _shape_module
from rcgrpo.base.errors import UserError
from rcgrpo.base.host import GiB, gib
from rcgrpo.base.stages import ENGINE_STAGES, FINETUNE_STAGES, RL_STAGES
from rcgrpo.config.io import set_setting
from rcgrpo.model.shape import LAYER_PROJECTIONS, ModelShape
from rcgrpo.rollout.vllm_engine import CPU_KV_CACHE_GIB
from rcgrpo.training.memory_ways_out import fewer_rollouts, ways_out
from rcgrpo_kernels.chunked import CHUNK_BYTES, CHUNK_ROWS

__all__ = ["MemoryPlan", "MemoryPlanError", "plan_stage", "check_stage", "rollouts_per_rank"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MARGIN_FIXED = 1 * GiB
MARGIN_FRACTION = 0.05
ENGINE_ASLEEP_CUDA = 1 * GiB  # what a level-1 sleeping vLLM keeps (CUDA graphs, workspaces)
ENGINE_CPU_KV_CACHE = CPU_KV_CACHE_GIB * GiB  # the KV cache the run's vLLM engine gets on CPU
ROLLOUT_BYTES_PER_TOKEN = 96  # host bytes per token of a held rollout (see the module docstring)

# Names that moved out of this module (issue 26) -> their module now. They
# still resolve here, for one release, with a DeprecationWarning.
_MOVED_NAMES = {
    "ModelShapeError": _shape_module,
    "device_memory_bytes": _host_module,
    "check_disk": _host_module,
    "DiskPlanError": _host_module,
    "DISK_MARGIN_FRACTION": _host_module,
}


def __getattr__(name: str):
    home = _MOVED_NAMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} moved to {home.__name__}.{name}; the old name goes in rcgrpo 0.2",
                  DeprecationWarning, stacklevel=2)
    return getattr(home, name)


class MemoryPlanError(UserError, RuntimeError):
    """A stage's estimated memory need exceeds the device; the message names the ways out."""


# ------------------------------------------------------------------ the plan


@dataclass
class MemoryPlan:
    """Per-rank estimate of one stage. ``phases`` maps a phase ("rollout",
    "update") to its items in bytes; the peak phase plus the margin is the
    need. ``device_bytes`` is one GPU's memory on CUDA, the host's on CPU
    (shared by ``local_world_size`` ranks)."""

    stage: str
    device_type: str
    device_bytes: int
    world_size: int
    local_world_size: int
    phases: dict[str, dict[str, int]]
    notes: list[str] = field(default_factory=list)
    # what the plan was made from, so that check_stage can re-plan the ways out
    shape: Optional[ModelShape] = field(default=None, repr=False)
    cfg: Any = field(default=None, repr=False)
    engine_alive: bool = field(default=True, repr=False)
    # On CUDA: what each rank holds in the host's memory (the rollouts), and
    # that memory (0: not checked). On CPU such items are in the phases.
    host_items: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    rctp_entries: int = field(default=0, repr=False)

    def phase_bytes(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phase_bytes(self.peak_phase)

    @property
    def margin_bytes(self) -> int:
        return int(MARGIN_FIXED + MARGIN_FRACTION * self.peak_bytes)

    @property
    def need_bytes(self) -> int:
        """Per rank: the peak phase plus the safety margin."""
        return self.peak_bytes + self.margin_bytes

    @property
    def available_bytes(self) -> int:
        """Per rank: the whole device on CUDA, the host's share on CPU."""
        if self.device_type == "cpu":
            return self.device_bytes // max(1, self.local_world_size)
        return self.device_bytes

    @property
    def host_need_bytes(self) -> int:
        """On CUDA: the host memory all of this node's ranks hold (no margin:
        the device's margin covers the process's own)."""
        return sum(self.host_items.values()) * max(1, self.local_world_size)

    @property
    def host_fits(self) -> bool:
        return not self.host_bytes or self.host_need_bytes <= self.host_bytes

    @property
    def device_fits(self) -> bool:
        return self.need_bytes <= self.available_bytes

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    @property
    def compute_bytes(self) -> int:
        """c: bytes per parameter of the compute dtype (``model.dtype``)."""
        return DTYPE_BYTES[self.cfg.model.dtype]

    @property
    def micro_batch_tokens(self) -> int:
        """T: the tokens of one micro-batch, whose activations the update holds."""
        return tokens_per_micro_batch(self.cfg, self.stage)

    def replan(self, changes: Optional[dict[str, Any]] = None, world_size: Optional[int] = None,
               local_world_size: Optional[int] = None) -> "MemoryPlan":
        """This plan re-estimated with the dotted settings `changes` applied to
        a copy of its config, and/or over another number of ranks."""
        return plan_stage(self.shape, _with_settings(self.cfg, changes or {}), self.stage,
                          world_size=self.world_size if world_size is None else world_size,
                          local_world_size=self.local_world_size if local_world_size is None else local_world_size,
                          device_type=self.device_type, device_bytes=self.device_bytes,
                          engine_alive=self.engine_alive, host_bytes=self.host_bytes,
                          rctp_entries=self.rctp_entries)

    def biggest(self, n: int = 3) -> list[tuple[str, int]]:
        items = sorted(self.phases[self.peak_phase].items(), key=lambda kv: -kv[1])
        return [(k, v) for k, v in items if v > 0][:n]

    def summary(self) -> str:
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if self.device_type == "cpu":
            where = f"cpu, {ranks} ({self.local_world_size} on this host), host memory {gib(self.device_bytes)} GiB"
        else:
            where = f"cuda, {ranks}, {gib(self.device_bytes)} GiB per device"
        lines = [f"memory plan for stage {self.stage} ({where}); GiB per rank"]
        width = max((len(k) for items in self.phases.values() for k in items), default=10)
        for phase, items in self.phases.items():
            peak = " (peak)" if phase == self.peak_phase and len(self.phases) > 1 else ""
            lines.append(f"  {phase} phase{peak}: {gib(self.phase_bytes(phase))}")
            for k, v in items.items():
                lines.append(f"    {k:<{width}}  {gib(v):>7}")
        lines.append(f"  margin (1 GiB + 5%): {gib(self.margin_bytes)}")
        verdict = "fits" if self.fits else "does NOT fit"
        if self.device_type == "cpu" and self.local_world_size > 1:
            lines.append(f"  need {gib(self.need_bytes)} per rank x {self.local_world_size} = "
                         f"{gib(self.need_bytes * self.local_world_size)} of {gib(self.device_bytes)}: {verdict}")
        else:
            lines.append(f"  need {gib(self.need_bytes)} of {gib(self.available_bytes)}: {verdict}")
        for k, v in self.host_items.items():
            lines.append(f"  host: {k}  {gib(v)} per rank")
        if self.host_bytes:
            lines.append(f"  host need {gib(self.host_need_bytes)} of {gib(self.host_bytes)}: "
                         f"{'fits' if self.host_fits else 'does NOT fit'}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _with_settings(cfg, changes: dict[str, Any]):
    """A copy of `cfg` with the dotted settings `changes`, each checked
    against its type (rcgrpo.config.io.set_setting)."""
    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        set_setting(new, key, value, "a way out of the memory plan")
    return new


# ------------------------------------------------------------------ the items


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _lora_targets(cfg) -> list[str]:
    names: list[str] = []
    for t in cfg.model.lora.target_modules:
        for n in (LAYER_PROJECTIONS if t == "all-linear" else (t,)):
            if n not in names:
                names.append(n)
    return names


def _lora_adapter_params(shape: ModelShape, cfg) -> tuple[int, int, list[str]]:
    """(adapter + reward-row params, in-features of the adapted Linears of one
    layer, target names this estimate does not know)."""
    r = int(cfg.model.lora.r)
    dims = shape.linear_dims()
    per_layer, in_features, unknown = 0, 0, []
    root = 0
    for t in _lora_targets(cfg):
        if t in dims:
            i, o = dims[t]
            per_layer += r * (i + o)
            in_features += i
        elif t in ("lm_head", "embed_tokens"):
            root += r * (shape.hidden_size + shape.vocab_size)
        else:
            unknown.append(t)
    return shape.num_layers * per_layer + root + 2 * shape.hidden_size, in_features, unknown


def tokens_per_micro_batch(cfg, stage: str) -> int:
    """T of the module docstring: an RL stage's trajectory longer than a
    micro-batch gets a micro-batch of its own."""
    if stage in RL_STAGES:
        return max(int(cfg.run.micro_batch_tokens), int(cfg.grpo.max_total_tokens))
    return int(cfg.run.micro_batch_tokens)


def _activations(shape: ModelShape, cfg, tokens: int, c: int, r: int, lora_in_features: int) -> dict[str, int]:
    h, i, q, kv, L = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim, shape.num_layers
    per_token = 4 * r * h + c * (2 * h + 3 * q + 2 * kv + 4 * i)
    if cfg.model.lora.enabled and cfg.model.lora.dropout > 0:
        per_token += (c + 1) * lora_in_features
    layer = tokens * per_token
    items: dict[str, int] = {}
    if cfg.model.gradient_checkpointing:
        items["activations (checkpointed: layer inputs + 1 layer)"] = L * tokens * h * r + layer
    else:
        items[f"activations ({L} layers, T={tokens})"] = L * layer
    if cfg.run.fused:
        loss = 2 * min(CHUNK_ROWS * shape.vocab_size * 4, CHUNK_BYTES)
        items["loss (fused chunks) + head buffers"] = loss + 2 * tokens * h * 4
    else:
        items["logits + their gradient (fp32)"] = 2 * tokens * shape.vocab_size * 4 + 2 * tokens * h * 4
    return items


def rollouts_per_rank(cfg, world_size: int = 1) -> int:
    """How many rollouts a rank holds at once in an RL step (see the module docstring)."""
    groups = max(1, world_size // max(1, int(cfg.run.engine_tp_size)))
    held = _ceil_div(int(cfg.grpo.batch_size), groups) * int(cfg.grpo.group_size)
    return 2 * held if cfg.grpo.dynamic_sampling else held


def _rollouts(cfg, stage: str, world_size: int, rctp_entries: int) -> dict[str, int]:
    """The item of the rollouts a rank holds, named by the settings that size
    it (none for a stage that holds few)."""
    g = cfg.grpo
    if stage in RL_STAGES:
        n = rollouts_per_rank(cfg, world_size)
        how = f"grpo.batch_size {g.batch_size} x grpo.group_size {g.group_size}"
        if world_size // max(1, int(cfg.run.engine_tp_size)) > 1:
            how += " over the engine groups"
        if g.dynamic_sampling:
            how += " x 2 (dynamic sampling)"
        # The sampled-reward probe plays its rollouts at once too (on every
        # rank), between steps: the larger of the two is what is held.
        probe = int(g.eval_rollouts) if int(g.eval_every) > 0 else 0
        if probe > n:
            n, how = probe, f"grpo.eval_rollouts {probe}, the sampled-reward probe"
    elif stage == "rctp-data" and rctp_entries:  # rank 0 alone builds the set
        n = rctp_entries * int(cfg.rctp.failure_attempts)
        how = f"{rctp_entries} training entries x rctp.failure_attempts {cfg.rctp.failure_attempts}"
    else:
        return {}
    label = f"rollouts held ({n}: {how}; <= {g.max_total_tokens} tokens each)"
    return {label: n * int(g.max_total_tokens) * ROLLOUT_BYTES_PER_TOKEN}


def _engine(shape: ModelShape, cfg, device_type: str, device_bytes: int) -> tuple[int, int, Optional[str]]:
    """(bytes awake, bytes asleep, note) of the rollout engine on this device."""
    kind = cfg.run.engine
    if device_type == "cpu":
        if kind == "hf":
            return 4 * shape.params, 4 * shape.params, None
        return 4 * shape.params + ENGINE_CPU_KV_CACHE, 4 * shape.params, None
    if kind == "hf":
        return 0, 0, "the transformers engine keeps its fp32 copy on the host, not on the GPU"
    return int(cfg.run.engine_memory_fraction * device_bytes), ENGINE_ASLEEP_CUDA, None


@dataclass
class _TrainingState:
    """What a trained stage holds besides its activations: `held` through both
    phases, `grads` in the update phase only, listed there right after the
    first `grads_after` held items (the adapters / the master weights);
    `residual`, the bytes of the residual stream; `lora_in`, the in-features
    of one layer's adapted Linears."""

    held: dict[str, int]
    grads: dict[str, int]
    grads_after: int
    residual: int
    lora_in: int = 0

    def update_items(self) -> dict[str, int]:
        held, grads = list(self.held.items()), list(self.grads.items())
        at = self.grads_after
        return dict(held[:at] + grads[:1] + held[at:] + grads[1:])


def _lora_state(shape: ModelShape, cfg, notes: list[str]) -> _TrainingState:
    """LoRA: the frozen base in the compute dtype, fp32 adapters with their
    gradients and AdamW state."""
    dtype = cfg.model.dtype
    adapters, lora_in, unknown = _lora_adapter_params(shape, cfg)
    if unknown:
        notes.append(f"LoRA targets {unknown} are not known to this estimate and count nothing")
    held = {f"frozen base ({dtype})": DTYPE_BYTES[dtype] * shape.params,
            "adapters + reward rows (fp32)": 4 * adapters,
            "adapter AdamW state (fp32)": 8 * adapters}
    grads = {"adapter gradients (fp32)": 4 * adapters}
    return _TrainingState(held, grads, grads_after=2, residual=DTYPE_BYTES[dtype], lora_in=lora_in)


def _full_state(shape: ModelShape, cfg, stage: str, world_size: int) -> _TrainingState:
    """Full fine-tuning: fp32 master weights, gradients and AdamW state
    (sharded over the ranks), an RL stage's KL reference, and the weights
    in flight in the compute dtype (FSDP2's unsharded layers, or autocast's
    copies in one process)."""
    dtype, P, W = cfg.model.dtype, shape.params, world_size
    c = DTYPE_BYTES[dtype]
    shard = "" if W == 1 else f", 1/{W}"
    held = {f"weights (fp32 master{shard})": _ceil_div(4 * P, W), f"AdamW state (fp32{shard})": _ceil_div(8 * P, W)}
    grads = {f"gradients (fp32{shard})": _ceil_div(4 * P, W)}
    if stage in RL_STAGES and cfg.grpo.beta > 0:
        if W == 1 and c < 4:  # the decoder's Linear weights in the compute dtype, the root fp32
            root = shape.root_params
            held[f"KL reference ({dtype} Linear weights, fp32 embeddings and head)"] = c * (P - root) + 4 * root
        else:
            held[f"KL reference ({dtype}{shard})"] = _ceil_div(c * P, W)
    if W > 1:
        in_flight = shape.root_params + 2 * shape.layer_params
        grads[f"unsharded layers in flight ({dtype}: root + 2 layers)"] = c * in_flight
    elif c < 4:
        grads[f"autocast weight copies ({dtype})"] = c * P
    # fp32 weights: the residual stream stays fp32 under autocast
    return _TrainingState(held, grads, grads_after=1, residual=4)


def _check_plan_arguments(cfg, stage: str, world_size: int, local_world_size: int, device_type: str,
                          device_bytes: int) -> None:
    if stage not in RL_STAGES + FINETUNE_STAGES + ENGINE_STAGES:
        raise ValueError(f"unknown stage {stage!r}: one of {RL_STAGES + FINETUNE_STAGES + ENGINE_STAGES}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be cuda or cpu, got {device_type!r}")
    if world_size < 1 or not 1 <= local_world_size <= world_size:
        raise ValueError(f"need 1 <= local_world_size ({local_world_size}) <= world_size ({world_size})")
    if device_bytes <= 0:
        raise ValueError(f"device_bytes must be > 0, got {device_bytes}")
    if cfg.model.lora.enabled and world_size > 1:
        raise ValueError(f"model.lora.enabled is single-process only; this plan has {world_size} ranks")


# ------------------------------------------------------------------ the stage


def plan_stage(
    shape: ModelShape,
    cfg,
    stage: str,
    *,
    world_size: int = 1,
    local_world_size: int = 1,
    device_type: str = "cuda",
    device_bytes: int,
    engine_alive: bool = True,
    host_bytes: int = 0,
    rctp_entries: int = 0,
) -> MemoryPlan:
    """Estimate what `stage` needs per rank (see the module docstring for the
    rules). `host_bytes`: on CUDA, the host's memory, which the rollouts of an
    RL stage must fit (0: not checked). `rctp_entries`: the training entries
    "rctp-data" plays rollouts of (0: not counted)."""
    _check_plan_arguments(cfg, stage, world_size, local_world_size, device_type, device_bytes)
    awake, asleep, note = _engine(shape, cfg, device_type, device_bytes)
    notes = [note] if note else []
    plan = dict(stage=stage, device_type=device_type, device_bytes=int(device_bytes), world_size=world_size,
                local_world_size=local_world_size, notes=notes, shape=shape, cfg=cfg, engine_alive=engine_alive,
                rctp_entries=rctp_entries)
    rollouts = _rollouts(cfg, stage, world_size, rctp_entries)
    if device_type == "cuda":
        plan.update(host_items=rollouts, host_bytes=int(host_bytes))
    on_host = rollouts if device_type == "cpu" else {}  # on CPU the host is the device

    if stage in ENGINE_STAGES:
        items = {"engine (awake)": awake, **on_host}
        if stage == "eval" and device_type == "cpu":
            items["policy loaded to hand over its weights (fp32)"] = 4 * shape.params
        return MemoryPlan(phases={"rollout": items}, **plan)

    lora = bool(cfg.model.lora.enabled)
    state = _lora_state(shape, cfg, notes) if lora else _full_state(shape, cfg, stage, world_size)
    update = state.update_items()
    update.update(_activations(shape, cfg, tokens_per_micro_batch(cfg, stage), DTYPE_BYTES[cfg.model.dtype],
                               state.residual, state.lora_in))
    awake_name = "engine (awake)"
    asleep_name = "engine (asleep: weights, no KV cache)" if device_type == "cpu" else "engine (asleep)"
    phases: dict[str, dict[str, int]] = {}
    if stage in RL_STAGES:
        phases["rollout"] = {**state.held, awake_name: awake, **on_host}
        phases["update"] = {**update, asleep_name: asleep, **on_host}
    else:
        if engine_alive:
            update[asleep_name] = asleep
        phases["update"] = update
    return MemoryPlan(phases=phases, **plan)


# ------------------------------------------------------------------ the check


def check_stage(plan: MemoryPlan) -> None:
    """Raise MemoryPlanError (one line) when the plan does not fit its device
    (or, on CUDA, its rollouts the host)."""
    if plan.fits:
        return
    if plan.device_fits:  # CUDA, and the host is short of the rollouts' memory
        raise _host_error(plan)
    ranks = f"{plan.world_size} rank{'s' if plan.world_size != 1 else ''}"
    if plan.device_type == "cpu" and plan.local_world_size == 1:
        have = f"needs ~{gib(plan.need_bytes)} GiB, the host has {gib(plan.device_bytes)} GiB"
    elif plan.device_type == "cpu":
        have = (f"needs ~{gib(plan.need_bytes)} GiB per rank x {plan.local_world_size} on this host = "
                f"{gib(plan.need_bytes * plan.local_world_size)} GiB, the host has {gib(plan.device_bytes)} GiB")
    else:
        have = f"needs ~{gib(plan.need_bytes)} GiB per rank, the GPU has {gib(plan.device_bytes)} GiB"
    biggest = ", ".join(f"{k} {gib(v)} GiB" for k, v in plan.biggest())
    raise MemoryPlanError(
        f"memory plan: stage {plan.stage} does not fit ({plan.device_type}, {ranks}): {have} "
        f"({plan.peak_phase} phase + 1 GiB + 5% margin; rough estimate, see rcgrpo.training.memory_plan); "
        f"biggest: {biggest}; ways out: {_ways_out_text(plan)}"
    )


def _host_error(plan: MemoryPlan) -> MemoryPlanError:
    """On CUDA: the rollouts do not fit the host's memory (the device is fine)."""
    items = ", ".join(f"{k} {gib(v)} GiB" for k, v in plan.host_items.items())
    ranks = f" x {plan.local_world_size} ranks on this host" if plan.local_world_size > 1 else ""
    ways = [f"{f} (~{gib(p.host_need_bytes)} GiB)" for f, p in fewer_rollouts(plan)]
    return MemoryPlanError(
        f"memory plan: stage {plan.stage} does not fit the host's memory: {items}{ranks} = "
        f"~{gib(plan.host_need_bytes)} GiB, the host has {gib(plan.host_bytes)} GiB (rough estimate, see "
        f"rcgrpo.training.memory_plan); ways out: {'; '.join(ways) or 'a host with more memory'}"
    )


def _ways_out_text(plan: MemoryPlan) -> str:
    """The ways out that fit alone, then those that cut the need by >= 10%
    but do not fit alone (worth combining)."""
    ways = ways_out(plan) if plan.shape is not None and plan.cfg is not None else []

    def label(f: str, p: MemoryPlan) -> str:
        return f if "GiB per rank" in f else f"{f} (~{gib(p.need_bytes)} GiB)"

    listed = [label(f, p) for f, p in ways if p.fits]
    helping = sorted(((f, p) for f, p in ways if not p.fits and p.need_bytes < 0.9 * plan.need_bytes),
                     key=lambda fp: fp[1].need_bytes)
    if helping:
        listed.append("not enough alone: " + ", ".join(label(f, p) for f, p in helping))
    return "; ".join(listed) if listed else "none found by this estimate (a device with more memory)"
