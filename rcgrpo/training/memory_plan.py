"""Will a training stage fit the device? A pure estimate, made before any model loads.

`plan_stage` adds up what one stage needs per rank, phase by phase, from the
model's shapes (`ModelShape`: a config.json, optionally with the exact
parameter count from the safetensors headers) and the run's settings;
`check_stage` raises `MemoryPlanError`, one line naming the stage, needed vs
available GiB per rank, the biggest items, and the ways out that would help,
each re-estimated (LoRA, more ranks, gradient checkpointing, shorter
micro-batches, ...). Nothing here loads a model or allocates a tensor; torch is
imported only by `device_memory_bytes` on CUDA.

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
  "all-linear" = the seven projections), plus the two trainable reward-token
  rows (2 x hidden), are fp32 with fp32 gradients and AdamW state: 16 B/param.
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
  logits, only chunks (2 x min(256 rows x vocab x 4 B, 256 MiB)); the plain
  path builds fp32 logits and their gradient, 2 x T x vocab x 4 B. Plus two
  fp32 T x H buffers (final norm, hidden-state gradient).
* The rollout engine (vLLM, in-process; ``run.engine`` "auto" is taken to be
  vLLM, the bigger case): on CUDA it takes ``run.engine_memory_fraction`` of the
  device while awake and sleeps during updates (level 1; counted as 1 GiB left:
  CUDA graphs, workspaces); on CPU it holds fp32 weights (4 B/param) all the
  time and its 2 GiB KV cache while awake (asleep, the cache's memory is
  released: ``VLLMEngine.sleep``). The transformers engine
  ("hf") loads its own fp32 copy on the host: 4 B/param on CPU, nothing on a GPU.
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
* Disk (`check_disk`): a file the run must write before it can start, the
  token-extended copy of a model without the reward tokens (rcgrpo.model.loading:
  as large as the model's safetensors, + 5%), is refused when its disk has
  less free space, before it is written.
* On CUDA each rank has its own device: the per-rank need is compared with the
  device's total memory. On CPU the ranks of a node share the host: the
  per-rank need x the local world size is compared with the host's memory.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from rcgrpo.base import json_input
from rcgrpo.base.errors import UserError
from rcgrpo.base.stages import ENGINE_STAGES, FINETUNE_STAGES, RL_STAGES

__all__ = ["ModelShape", "ModelShapeError", "MemoryPlan", "MemoryPlanError", "plan_stage", "check_stage", "check_disk",
           "device_memory_bytes"]

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MARGIN_FIXED = 1 * GiB
MARGIN_FRACTION = 0.05
ENGINE_ASLEEP_CUDA = 1 * GiB  # what a level-1 sleeping vLLM keeps (CUDA graphs, workspaces)
ENGINE_CPU_KV_CACHE = 2 * GiB  # train.engine_kwargs: kv_cache_gib=2
FUSED_CHUNK_ROWS = 256  # rcgrpo_kernels.chunked.CHUNK_ROWS
FUSED_CHUNK_CAP = 256 << 20  # rcgrpo_kernels.chunked.CHUNK_BYTES
ROLLOUT_BYTES_PER_TOKEN = 96  # host bytes per token of a held rollout (see the module docstring)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK_STEPS = (2, 4, 8, 16, 32, 64, 128)
GPUS_PER_NODE = 8


class MemoryPlanError(UserError, RuntimeError):
    """A stage's estimated memory need exceeds the device; the message names the ways out."""


class ModelShapeError(UserError, ValueError):
    """A model folder's config.json (or a weights header) cannot be read for its shapes."""


# ------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only (Llama / Qwen2 / Mistral style) model.

    ``num_attention_heads``, ``num_key_value_heads`` and ``head_dim`` are 0 when
    unknown: then q and kv are taken as ``hidden_size`` wide (plain multi-head).
    """

    params: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    tied_embeddings: bool
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0

    @property
    def q_dim(self) -> int:
        if self.num_attention_heads and self.head_dim:
            return self.num_attention_heads * self.head_dim
        return self.hidden_size

    @property
    def kv_dim(self) -> int:
        if self.num_key_value_heads and self.head_dim:
            return self.num_key_value_heads * self.head_dim
        return self.hidden_size

    @property
    def root_params(self) -> int:
        """Embeddings + LM head (when untied) + final norm: FSDP2's root unit."""
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tied_embeddings else 2) + self.hidden_size

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (the average, from the total)."""
        return max(0, self.params - self.root_params) // max(1, self.num_layers)

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of a layer."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """Shapes and parameter count from a config.json dict (a nested
        ``text_config`` is used when the top level has no ``hidden_size``).

        Biases: q/k/v for model_type qwen2; q/k/v/o when ``attention_bias`` is
        true (Llama, Qwen3); gate/up/down when ``mlp_bias`` is true. Qwen3's
        per-head q/k norms are counted. ``tie_word_embeddings`` defaults to
        false, the default of the Llama, Qwen2 and Mistral configs.
        """
        if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        try:
            h = int(config["hidden_size"])
            inter = int(config["intermediate_size"])
            layers = int(config["num_hidden_layers"])
            vocab = int(config["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config has no {e.args[0]!r}: not a Llama/Qwen2/Mistral-style config") from None
        heads = int(config.get("num_attention_heads") or 0)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or (h // heads if heads else 0))
        tied = bool(config.get("tie_word_embeddings", False))
        model_type = str(config.get("model_type", ""))
        q = heads * head_dim if heads and head_dim else h
        kv = kv_heads * head_dim if kv_heads and head_dim else h

        attn = h * q + 2 * h * kv + q * h
        if model_type == "qwen2":
            attn += q + 2 * kv
        elif config.get("attention_bias"):
            attn += q + 2 * kv + h
        if model_type == "qwen3":
            attn += 2 * head_dim  # q_norm, k_norm
        mlp = 3 * h * inter + ((2 * inter + h) if config.get("mlp_bias") else 0)
        per_layer = attn + mlp + 2 * h  # + input and post-attention RMSNorms
        params = layers * per_layer + vocab * h * (1 if tied else 2) + h
        return cls(params, h, inter, layers, vocab, tied, heads, kv_heads, head_dim)

    @classmethod
    def from_folder(cls, folder: Union[str, os.PathLike]) -> "ModelShape":
        """config.json's shapes with the exact parameter count read from the
        headers of the folder's *.safetensors files (no tensor data is read;
        a tensor stored twice, or a tied LM head stored next to its embedding,
        counts once). Without safetensors files, the count from the config."""
        folder = Path(folder)
        path = folder / "config.json"
        try:
            shape = cls.from_config(json_input.read_file(path, expect=dict))
        except OSError as e:
            raise ModelShapeError(f"model config {path} cannot be read: {e.strerror or e}") from None
        except (ValueError, TypeError) as e:  # not UTF-8 / JSON, too deep, a non-number where a size belongs
            raise ModelShapeError(f"model config {path} cannot be used: {e}") from None
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return shape
        from safetensors import safe_open

        shapes: dict[str, list[int]] = {}
        for path in files:
            try:
                with safe_open(str(path), framework="numpy") as f:
                    for name in f.keys():
                        shapes[name] = list(f.get_slice(name).get_shape())
            except Exception as e:  # safetensors raises several unrelated types for a bad header
                raise ModelShapeError(f"weights file {path} cannot be read: {e}") from None
        if shape.tied_embeddings and any(n.endswith("embed_tokens.weight") for n in shapes):
            shapes = {n: s for n, s in shapes.items() if not n.endswith("lm_head.weight")}
        total = 0
        for dims in shapes.values():
            n = 1
            for d in dims:
                n *= int(d)
            total += n
        vocab = shape.vocab_size
        for name, dims in shapes.items():
            if name.endswith("embed_tokens.weight") and len(dims) == 2:
                vocab = int(dims[0])  # the stored rows (reward tokens may have been added)
        return cls(total, shape.hidden_size, shape.intermediate_size, shape.num_layers, vocab,
                   shape.tied_embeddings, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim)


# ------------------------------------------------------------------ the plan


def _gib(b: float) -> str:
    return f"{b / GiB:.1f}"


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

    def biggest(self, n: int = 3) -> list[tuple[str, int]]:
        items = sorted(self.phases[self.peak_phase].items(), key=lambda kv: -kv[1])
        return [(k, v) for k, v in items if v > 0][:n]

    def summary(self) -> str:
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if self.device_type == "cpu":
            where = f"cpu, {ranks} ({self.local_world_size} on this host), host memory {_gib(self.device_bytes)} GiB"
        else:
            where = f"cuda, {ranks}, {_gib(self.device_bytes)} GiB per device"
        lines = [f"memory plan for stage {self.stage} ({where}); GiB per rank"]
        width = max((len(k) for items in self.phases.values() for k in items), default=10)
        for phase, items in self.phases.items():
            peak = " (peak)" if phase == self.peak_phase and len(self.phases) > 1 else ""
            lines.append(f"  {phase} phase{peak}: {_gib(self.phase_bytes(phase))}")
            for k, v in items.items():
                lines.append(f"    {k:<{width}}  {_gib(v):>7}")
        lines.append(f"  margin (1 GiB + 5%): {_gib(self.margin_bytes)}")
        verdict = "fits" if self.fits else "does NOT fit"
        if self.device_type == "cpu" and self.local_world_size > 1:
            lines.append(f"  need {_gib(self.need_bytes)} per rank x {self.local_world_size} = "
                         f"{_gib(self.need_bytes * self.local_world_size)} of {_gib(self.device_bytes)}: {verdict}")
        else:
            lines.append(f"  need {_gib(self.need_bytes)} of {_gib(self.available_bytes)}: {verdict}")
        for k, v in self.host_items.items():
            lines.append(f"  host: {k}  {_gib(v)} per rank")
        if self.host_bytes:
            lines.append(f"  host need {_gib(self.host_need_bytes)} of {_gib(self.host_bytes)}: "
                         f"{'fits' if self.host_fits else 'does NOT fit'}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _lora_targets(cfg) -> list[str]:
    names: list[str] = []
    for t in cfg.model.lora.target_modules:
        for n in (PROJECTIONS if t == "all-linear" else (t,)):
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


def _tokens_per_micro_batch(cfg, stage: str) -> int:
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
        loss = 2 * min(FUSED_CHUNK_ROWS * shape.vocab_size * 4, FUSED_CHUNK_CAP)
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
    if stage not in RL_STAGES + FINETUNE_STAGES + ENGINE_STAGES:
        raise ValueError(f"unknown stage {stage!r}: one of {RL_STAGES + FINETUNE_STAGES + ENGINE_STAGES}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be cuda or cpu, got {device_type!r}")
    if world_size < 1 or not 1 <= local_world_size <= world_size:
        raise ValueError(f"need 1 <= local_world_size ({local_world_size}) <= world_size ({world_size})")
    if device_bytes <= 0:
        raise ValueError(f"device_bytes must be > 0, got {device_bytes}")
    dtype = cfg.model.dtype
    c = DTYPE_BYTES[dtype]
    lora = bool(cfg.model.lora.enabled)
    if lora and world_size > 1:
        raise ValueError(f"model.lora.enabled is single-process only; this plan has {world_size} ranks")
    P, W = shape.params, world_size
    notes: list[str] = []
    awake, asleep, note = _engine(shape, cfg, device_type, device_bytes)
    if note:
        notes.append(note)
    plan = dict(stage=stage, device_type=device_type, device_bytes=int(device_bytes), world_size=W,
                local_world_size=local_world_size, notes=notes, shape=shape, cfg=cfg, engine_alive=engine_alive)
    rollouts = _rollouts(cfg, stage, W, rctp_entries)
    plan["rctp_entries"] = rctp_entries
    if device_type == "cuda":
        plan.update(host_items=rollouts, host_bytes=int(host_bytes))
    on_host = rollouts if device_type == "cpu" else {}  # on CPU the host is the device

    if stage in ENGINE_STAGES:
        items = {"engine (awake)": awake, **on_host}
        if stage == "eval" and device_type == "cpu":
            items["policy loaded to hand over its weights (fp32)"] = 4 * P
        return MemoryPlan(phases={"rollout": items}, **plan)

    held: dict[str, int] = {}  # both phases
    grads: dict[str, int] = {}  # update phase only
    lora_in = 0
    if lora:
        adapters, lora_in, unknown = _lora_adapter_params(shape, cfg)
        if unknown:
            notes.append(f"LoRA targets {unknown} are not known to this estimate and count nothing")
        held[f"frozen base ({dtype})"] = c * P
        held["adapters + reward rows (fp32)"] = 4 * adapters
        grads["adapter gradients (fp32)"] = 4 * adapters
        held["adapter AdamW state (fp32)"] = 8 * adapters
        residual = c
    else:
        shard = "" if W == 1 else f", 1/{W}"
        held[f"weights (fp32 master{shard})"] = _ceil_div(4 * P, W)
        grads[f"gradients (fp32{shard})"] = _ceil_div(4 * P, W)
        held[f"AdamW state (fp32{shard})"] = _ceil_div(8 * P, W)
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
        residual = 4  # fp32 weights: the residual stream stays fp32 under autocast

    tokens = _tokens_per_micro_batch(cfg, stage)
    # update phase: the held items with the gradients right after the weights
    held_items, grad_items = list(held.items()), list(grads.items())
    at = 2 if lora else 1  # after the adapters / the master weights
    update = dict(held_items[:at] + grad_items[:1] + held_items[at:] + grad_items[1:])
    update.update(_activations(shape, cfg, tokens, c, residual, lora_in))
    awake_name = "engine (awake)"
    asleep_name = "engine (asleep: weights, no KV cache)" if device_type == "cpu" else "engine (asleep)"
    phases: dict[str, dict[str, int]] = {}
    if stage in RL_STAGES:
        phases["rollout"] = {**held, awake_name: awake, **on_host}
        phases["update"] = {**update, asleep_name: asleep, **on_host}
    else:
        if engine_alive:
            update[asleep_name] = asleep
        phases["update"] = update
    return MemoryPlan(phases=phases, **plan)


# ------------------------------------------------------------------ the check


def _with(cfg, changes: dict[str, Any]):
    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        obj = new
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return new


def _replan(plan: MemoryPlan, changes: Optional[dict[str, Any]] = None, world_size: Optional[int] = None,
            local_world_size: Optional[int] = None) -> MemoryPlan:
    return plan_stage(plan.shape, _with(plan.cfg, changes or {}), plan.stage,
                      world_size=plan.world_size if world_size is None else world_size,
                      local_world_size=plan.local_world_size if local_world_size is None else local_world_size,
                      device_type=plan.device_type, device_bytes=plan.device_bytes, engine_alive=plan.engine_alive,
                      host_bytes=plan.host_bytes, rctp_entries=plan.rctp_entries)


def _ranks_flag(plan: MemoryPlan, n: int) -> tuple[str, int]:
    """(torchrun command, local world size) for n ranks."""
    if plan.device_type == "cpu":
        # Ranks of one host share its memory: only more hosts help.
        local = plan.local_world_size
        return f"torchrun --nnodes {n // local} --nproc_per_node {local}", local
    if n <= GPUS_PER_NODE:
        return f"torchrun --nproc_per_node {n}", n
    return f"torchrun --nnodes {n // GPUS_PER_NODE} --nproc_per_node {GPUS_PER_NODE}", GPUS_PER_NODE


def _rollout_ways(plan: MemoryPlan) -> list[tuple[str, MemoryPlan]]:
    """The largest group size, and the largest batch, that fit (halving), when
    the rollouts held are what does not fit."""
    g = plan.cfg.grpo
    if plan.stage in RL_STAGES:
        settings = [("grpo.group_size", g.group_size, 2), ("grpo.batch_size", g.batch_size, max(1, g.mini_batches))]
    elif plan.stage == "rctp-data" and plan.rctp_entries:
        settings = [("rctp.failure_attempts", plan.cfg.rctp.failure_attempts, 1)]
    else:
        return []
    out = []
    for key, value, low in settings:
        n = value // 2
        while n >= low:
            p = _replan(plan, {key: n})
            if p.fits:
                out.append((f"--{key} {n}", p))
                break
            n //= 2
    return out


def _ways_out(plan: MemoryPlan) -> list[tuple[str, MemoryPlan]]:
    """Candidate changes, each with its re-estimated plan."""
    cfg, out = plan.cfg, []
    lora = cfg.model.lora.enabled
    single = {}  # single-process switches, for the combination below
    peak = plan.phases[plan.peak_phase]
    rollouts = next((v for k, v in peak.items() if k.startswith("rollouts held")), 0)
    if rollouts > 0.5 * plan.peak_bytes:  # the rollouts are most of the need: fewer of them first
        out.extend(_rollout_ways(plan))
    if plan.stage in ENGINE_STAGES:
        return out

    if not lora:
        p = _replan(plan, {"model.lora.enabled": True}, world_size=1, local_world_size=1)
        out.append(("--model.lora.enabled true" + (" in one process" if plan.world_size > 1 else ""), p))
        single["model.lora.enabled"] = True

    # more ranks (full fine-tuning: LoRA is single-process only); listed only
    # when some count fits, alone or with checkpointing / the fused loss
    step = plan.local_world_size if plan.device_type == "cpu" else 1
    extra: dict[str, Any] = {}
    extra_flags = []
    if not cfg.model.gradient_checkpointing:
        extra["model.gradient_checkpointing"] = True
        extra_flags.append("--model.gradient_checkpointing true")
    if not cfg.run.fused:
        extra["run.fused"] = True
        extra_flags.append("--fused")
    # ranks + those switches only when the switches alone do not fit
    tries = [({}, [])] + ([(extra, extra_flags)] if extra and not _replan(plan, extra).fits else [])
    for changes, flags in tries:
        found = None
        for n in (n * step for n in RANK_STEPS):
            if n <= plan.world_size:
                continue
            flag, local = _ranks_flag(plan, n)
            p = _replan(plan, {"model.lora.enabled": False, **changes}, world_size=n, local_world_size=local)
            if p.fits:
                found = (" ".join([flag, *flags]) + (" with --model.lora.enabled false" if lora else "")
                         + f" (~{_gib(p.need_bytes)} GiB per rank)", p)
                break
        if found:
            out.append(found)
            break

    if not cfg.model.gradient_checkpointing:
        out.append(("--model.gradient_checkpointing true", _replan(plan, {"model.gradient_checkpointing": True})))
        single["model.gradient_checkpointing"] = True
    if not cfg.run.fused:
        out.append(("--fused", _replan(plan, {"run.fused": True})))
        single["run.fused"] = True
    if plan.device_type == "cuda" and cfg.model.dtype == "float32":
        out.append(("--model.dtype bfloat16", _replan(plan, {"model.dtype": "bfloat16"})))
        single["model.dtype"] = "bfloat16"

    # shorter micro-batches, when activations dominate or that alone fits
    tokens = _tokens_per_micro_batch(cfg, plan.stage)
    update = plan.phases.get("update", {})
    acts_lead = bool(update) and max(update, key=update.get).startswith(("activations", "logits", "loss"))
    best = None
    t = tokens // 2
    while t >= 1024:
        if plan.stage in RL_STAGES and t < cfg.grpo.max_total_tokens:
            if t <= cfg.data.max_prompt_tokens:
                break  # a trajectory must hold its prompt
            changes = {"grpo.max_total_tokens": t, "run.micro_batch_tokens": t}
            flag = f"--grpo.max_total_tokens {t} --run.micro_batch_tokens {t} (shorter trajectories)"
        else:
            changes = {"run.micro_batch_tokens": t}
            flag = f"--run.micro_batch_tokens {t}"
        best = (flag, _replan(plan, changes))
        if best[1].fits:
            break
        t //= 2
    if best is not None and (best[1].fits or acts_lead):
        out.append(best)

    # a smaller engine share, when the rollout phase alone is over
    if (plan.device_type == "cuda" and cfg.run.engine != "hf" and "rollout" in plan.phases
            and plan.peak_phase == "rollout"):
        c = DTYPE_BYTES[cfg.model.dtype]
        engine_floor = c * plan.shape.params / max(1, cfg.run.engine_tp_size) + GiB  # its weights + some KV cache
        f = round(cfg.run.engine_memory_fraction - 0.05, 2)
        while f >= 0.05 and f * plan.device_bytes >= engine_floor:
            p = _replan(plan, {"run.engine_memory_fraction": f})
            if p.fits:
                out.append((f"--run.engine_memory_fraction {f:.2f}", p))
                break
            f = round(f - 0.05, 2)

    if len(single) > 1 and not any(p.fits for f, p in out if not f.startswith("torchrun")):
        flags = {"model.lora.enabled": "--model.lora.enabled true", "model.gradient_checkpointing":
                 "--model.gradient_checkpointing true", "run.fused": "--fused", "model.dtype": "--model.dtype bfloat16"}
        one = "model.lora.enabled" in single
        combo = " ".join(flags[k] for k in single) + " together"
        if one and plan.world_size > 1:
            combo += " in one process"
        out.append((combo, _replan(plan, single, world_size=1 if one else None, local_world_size=1 if one else None)))
    return out


def check_stage(plan: MemoryPlan) -> None:
    """Raise MemoryPlanError (one line) when the plan does not fit its device
    (or, on CUDA, its rollouts the host)."""
    if plan.fits:
        return
    if plan.device_fits:  # CUDA, and the host is short of the rollouts' memory
        items = ", ".join(f"{k} {_gib(v)} GiB" for k, v in plan.host_items.items())
        ranks = f" x {plan.local_world_size} ranks on this host" if plan.local_world_size > 1 else ""
        ways = [f"{f} (~{_gib(p.host_need_bytes)} GiB)" for f, p in _rollout_ways(plan)]
        raise MemoryPlanError(
            f"memory plan: stage {plan.stage} does not fit the host's memory: {items}{ranks} = "
            f"~{_gib(plan.host_need_bytes)} GiB, the host has {_gib(plan.host_bytes)} GiB (rough estimate, see "
            f"rcgrpo.training.memory_plan); ways out: {'; '.join(ways) or 'a host with more memory'}"
        )
    ranks = f"{plan.world_size} rank{'s' if plan.world_size != 1 else ''}"
    if plan.device_type == "cpu" and plan.local_world_size == 1:
        have = f"needs ~{_gib(plan.need_bytes)} GiB, the host has {_gib(plan.device_bytes)} GiB"
    elif plan.device_type == "cpu":
        have = (f"needs ~{_gib(plan.need_bytes)} GiB per rank x {plan.local_world_size} on this host = "
                f"{_gib(plan.need_bytes * plan.local_world_size)} GiB, the host has {_gib(plan.device_bytes)} GiB")
    else:
        have = f"needs ~{_gib(plan.need_bytes)} GiB per rank, the GPU has {_gib(plan.device_bytes)} GiB"
    biggest = ", ".join(f"{k} {_gib(v)} GiB" for k, v in plan.biggest())
    ways = _ways_out(plan) if plan.shape is not None and plan.cfg is not None else []

    def label(f: str, p: MemoryPlan) -> str:
        return f if "GiB per rank" in f else f"{f} (~{_gib(p.need_bytes)} GiB)"

    listed = [label(f, p) for f, p in ways if p.fits]
    # switches that cut the need by >= 10% but do not fit alone: worth combining
    helping = sorted(((f, p) for f, p in ways if not p.fits and p.need_bytes < 0.9 * plan.need_bytes),
                     key=lambda fp: fp[1].need_bytes)
    if helping:
        listed.append("not enough alone: " + ", ".join(label(f, p) for f, p in helping))
    way_text = "; ".join(listed) if listed else "none found by this estimate (a device with more memory)"
    raise MemoryPlanError(
        f"memory plan: stage {plan.stage} does not fit ({plan.device_type}, {ranks}): {have} "
        f"({plan.peak_phase} phase + 1 GiB + 5% margin; rough estimate, see rcgrpo.training.memory_plan); "
        f"biggest: {biggest}; ways out: {way_text}"
    )


def device_memory_bytes(device) -> int:
    """Total memory of `device` (a torch.device, "cuda", "cuda:1", "cpu"): the
    GPU's total on CUDA; on CPU the host's MemTotal (or the cgroup limit, when
    one is set and smaller)."""
    text = str(device)
    if text.startswith("cuda"):
        import torch

        index = getattr(device, "index", None)
        if index is None:
            index = int(text.split(":", 1)[1]) if ":" in text else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    if text != "cpu":
        raise ValueError(f"device_memory_bytes: cuda or cpu, got {text!r}")
    total = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                break
    if total is None:
        raise RuntimeError("/proc/meminfo has no MemTotal")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
        break
    return total


# ------------------------------------------------------------------ disk


class DiskPlanError(UserError, OSError):
    """A file the run must write would not fit its disk."""


DISK_MARGIN_FRACTION = 0.05  # filesystem overhead, a tokenizer and configs beside the weights


def check_disk(folder: Union[str, os.PathLike], need_bytes: int, what: str, way_out: str) -> None:
    """Refuse, before writing it, `what` (need_bytes, + 5%) when the disk
    holding `folder` (or its nearest existing parent) has less free space."""
    import shutil

    where = Path(folder).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    need = int(need_bytes * (1 + DISK_MARGIN_FRACTION))
    free = shutil.disk_usage(where).free
    if free < need:
        raise DiskPlanError(f"disk plan: {what} needs ~{_gib(need)} GiB in {folder}, the disk has "
                            f"{_gib(free)} GiB free; {way_out}")
