"""TrainablePolicy: what a training stage holds.

It resolves once whether the policy is plain, LoRA (peft) or FSDP2-sharded,
and it is the only module that asks. It owns the precision, the packed
forward to final hidden states, the LM-head weight the fused losses read, the
frozen reference, the weight stream the rollout engine loads, the stage
export and the checkpoint state.

Precision (every dtype of a training stage, stated once):

* **Master weights** (what the optimizer updates: every weight of a full
  fine-tune; under LoRA the adapters and the reward-token rows), their
  gradients, and AdamW's two moments are **float32**, always.
* **Compute dtype** = `model.dtype`: what the matmuls run in. In one process
  a bfloat16 compute dtype runs the decoder under `torch.autocast` (CUDA, or
  CPU for tests); under torchrun, FSDP2's `MixedPrecisionPolicy(param_dtype=
  compute, reduce_dtype=float32)` over fp32 shards. float32 (the CPU default)
  changes nothing. float16 is refused by the config (its gradients underflow
  without loss scaling).
* **Frozen weights** are held so that they compute like the policy: the LoRA
  base in the compute dtype (policy and reference are the same model, with
  and without adapters); the KL reference of a full fine-tune in one process
  with its decoder's Linear weights in the compute dtype and its embeddings,
  norms and head in fp32 (what autocast computes with; `_load_reference`),
  all compute dtype under FSDP2. Nothing updates them.
* **The losses' LM-head projection** gets hidden states in the compute dtype
  and, on CUDA, the head weight too (Triton dots in bf16); the kernels
  accumulate in float32 (rcgrpo_kernels/), and on CPU compute in float32 throughout.
* **Exports** are written in `model.export_dtype` (float32 by default), with
  config.json saying so.

Pure bf16 weights updated in place by AdamW would lose most of an RL update:
at lr 1e-6 a step is far below bf16's resolution of a typical weight
(tests/training/test_precision.py measures it).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from rcgrpo.base import distributed
from rcgrpo.model.attention import (
    decoder_hidden_states,
    default_attn_implementation,
    use_tree_attention,
)
from rcgrpo.model.loading import ModelFolderError, check_model_folder, load_model_weights
from rcgrpo.model.lora import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    adapters_off,
    head_weight,
    load_adapter,
    merged_weights,
    unwrap,
    wrap,
)
from rcgrpo.model.packing import PackedBatch
from rcgrpo.run.checkpoint import CheckpointError

MASTER_DTYPE = torch.float32
# Every torch dropout layer (LoRA's lora_dropout is an nn.Dropout).
DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                   torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


class PackedLM:
    """A causal LM scored on packed batches: final hidden states and the
    LM-head weight, both in the compute dtype, which is what the kernels take.
    The policy and its reference are each one."""

    def __init__(self, decoder: Callable, config, head_weight: Callable[[], torch.Tensor],
                 compute_dtype: torch.dtype, autocast_device: Optional[str], share_prefixes: bool = True):
        self._decoder, self._config, self._head_weight = decoder, config, head_weight
        self.compute_dtype = compute_dtype
        self._autocast_device = autocast_device  # None: parameters already are in the compute dtype
        # sdpa / flash-attn: the micro-batch's prefix tree in one varlen call, no [N, N] mask
        use_tree_attention(config)
        self.shares_prefixes = share_prefixes

    def _autocast(self):
        if self._autocast_device is None:
            return contextlib.nullcontext()
        return torch.autocast(self._autocast_device, dtype=self.compute_dtype)

    def hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        """[N, H] final hidden states (after the last norm), sequences kept apart."""
        with self._autocast():
            hidden = decoder_hidden_states(self._decoder, self._config, self.compute_dtype, batch,
                                           share_prefixes=self.shares_prefixes)
        return hidden.to(self.compute_dtype)  # autocast leaves the residual stream in fp32

    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]. On CUDA in the compute dtype (the Triton kernels' dots run
        in their inputs' dtype; the cast is differentiable, so the gradient
        reaches the fp32 master weight). On CPU as held: the chunked kernels
        compute in fp32 whatever they get, so a cast would only round and copy."""
        weight = self._head_weight()
        return weight.to(self.compute_dtype) if weight.is_cuda else weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V]: the reference (non-fused) path only; the fused kernels
        project chunk by chunk instead."""
        weight = self.lm_head_weight()
        return F.linear(hidden.to(weight.dtype), weight)


def _plain_head_weight(model) -> torch.Tensor:
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("LM heads with a bias are not supported by the packed losses")
    return head.weight


def _load_hf(folder: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str):
    # Here, not at the top: `import rcgrpo.train` (its early one-line errors) stays free of transformers.
    from transformers import AutoModelForCausalLM

    check_model_folder(folder)
    if attn_implementation == "auto":
        attn_implementation = default_attn_implementation(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                     attn_implementation=attn_implementation)
    except Exception as e:  # transformers raises many unrelated types for a bad folder
        raise ModelFolderError(f"cannot load the model in {folder}: {e}") from e
    return model.to(device)


def _load_reference(folder: Path, compute: torch.dtype, device: torch.device, attn_implementation: str,
                    sharded: bool) -> torch.nn.Module:
    """The frozen KL reference, held so that it computes exactly what the
    policy computed at step 0 (KL 0 before the first update, not rounding
    noise). In one process the policy runs fp32 masters under autocast:
    autocast casts each Linear's weight to the compute dtype, and leaves the
    embeddings, norms, residual stream and (on CPU) the LM head in fp32. So
    the reference holds the decoder's Linear weights in the compute dtype (the
    same rounding of the same fp32 values) and everything else in fp32. Under
    FSDP2 the mixed-precision policy casts every parameter of the policy to
    the compute dtype, and the reference is all compute dtype to match."""
    if sharded or compute == MASTER_DTYPE:
        model = _load_hf(folder, compute, device, attn_implementation)
    else:
        model = _load_hf(folder, MASTER_DTYPE, device, attn_implementation)
        head = model.get_output_embeddings()
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.to(compute)
    return model.eval().requires_grad_(False)


class TrainablePolicy:
    """The model a training stage updates, with everything that depends on
    how it is held. Build it with `TrainablePolicy.load`; the constructor
    takes already-built parts (tests build LoRA models themselves)."""

    def __init__(self, model: torch.nn.Module, *, compute_dtype: torch.dtype = torch.float32,
                 lora: bool = False, reference: Optional[torch.nn.Module] = None, share_prefixes: bool = True):
        self.model = model
        self.share_prefixes = share_prefixes
        self.lora = lora
        self.sharded = distributed.is_sharded(model)
        self.compute_dtype = compute_dtype
        self.device = next(model.parameters()).device
        self.lm = self._packed_lm(model, trains=True)
        self._reference_lm = None if reference is None else self._packed_lm(reference, trains=False)
        # True while the weights are exactly those the reference was built
        # from, so that the KL term has no gradient (RL's zero-variance steps
        # are then skipped) and the reference's log-probs are the policy's own
        # (the update then forwards no reference). `load` sets it; an optimizer
        # step (training.optimizer.clip_and_step) or a restored checkpoint
        # clears it, and so must a caller that changes the weights any other
        # way: a stale True would score KL as 0.
        self.equals_reference = False
        self.trainable_parameters()  # fails now, not at the first step, if a master weight is not fp32

    # ------------------------------------------------------------ building

    @classmethod
    def load(cls, folder: str | Path, model_cfg, device: torch.device, *, reference: bool,
             token_ids: Sequence[int] = ()) -> "TrainablePolicy":
        """The policy in `folder` (a token-extended model folder), as
        `model_cfg` (a `config.ModelConfig`) asks: LoRA or not, gradient
        checkpointing, prefix sharing, compute dtype; sharded with FSDP2 under torchrun.

        `reference`: also hold the frozen KL reference (a LoRA policy needs no
        copy: its reference is itself with the adapters off). `token_ids`: the
        reward tokens, whose embedding rows train under LoRA."""
        folder = Path(folder)
        compute = getattr(torch, model_cfg.dtype)
        lora = model_cfg.lora.enabled
        # The LoRA base is frozen: held in the compute dtype like the reference.
        model = _load_hf(folder, compute if lora else MASTER_DTYPE, device, model_cfg.attn_implementation)
        if lora:
            model = wrap(model, model_cfg.lora, token_ids, model_cfg.gradient_checkpointing)
        elif model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        ref = None
        if reference and not lora:
            ref = _load_reference(folder, compute, device, model_cfg.attn_implementation, distributed.active())
        if distributed.active():
            distributed.shard_model(model, compute_dtype=compute)
            if ref is not None:
                distributed.shard_model(ref)
        policy = cls(model, compute_dtype=compute, lora=lora, reference=ref, share_prefixes=model_cfg.share_prefixes)
        # The reference is the same folder's weights (LoRA: fresh adapters, B = 0, change nothing).
        policy.equals_reference = ref is not None or lora
        return policy

    def _plain_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The transformers model inside a PeftModel; any other model as is."""
        if self.lora and model is self.model:
            return unwrap(model)
        return model

    def _packed_lm(self, model: torch.nn.Module, trains: bool) -> PackedLM:
        plain = self._plain_model(model)
        # An FSDP-sharded model runs its decoder through the root's forward
        # hooks (distributed.shard_model); a plain one calls it directly.
        decoder = getattr(model, distributed.DECODER_METHOD, None) or plain.model
        if self.lora and trains:
            head = lambda: head_weight(model)  # noqa: E731  (trained token rows in place)
        else:
            head = lambda: _plain_head_weight(plain)  # noqa: E731
        # One process: autocast for the policy and the reference alike, so
        # that both compute the same way and the KL starts at 0 (up to the
        # rounding of the reference's weights). FSDP casts the parameters itself.
        autocast = self.device.type if self.compute_dtype != torch.float32 and not self.sharded else None
        return PackedLM(decoder, plain.config, head, self.compute_dtype, autocast, self.share_prefixes)

    # ------------------------------------------------------------ training

    def train_mode(self, dropout: bool = True) -> None:
        """nn.Module.train for an update (gradient checkpointing acts only in
        train mode). `dropout=False` keeps every dropout module off, as in
        eval mode: the RL stages' passes, where the policy being scored must
        be the one that sampled (the engine has no dropout) and PPO's ratio
        must be exactly 1 before the first step. Dropout a model applies
        functionally from its config (attention_dropout; 0 in Llama, Qwen2
        and SmolLM2) is not switched off."""
        self.model.train()
        if not dropout:
            for module in self.model.modules():
                if isinstance(module, DROPOUT_MODULES):
                    module.eval()

    def eval_mode(self) -> None:
        """Dropout off (nn.Module.eval) for scoring and rollouts."""
        self.model.eval()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The master weights; fp32 by construction (module docstring)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        wrong = {str(p.dtype) for p in params if p.dtype != MASTER_DTYPE}
        if wrong:
            raise TypeError(f"trainable weights must be float32 master weights, found {sorted(wrong)}; "
                            "load the policy through TrainablePolicy.load (model.dtype is the compute dtype)")
        return params

    @contextlib.contextmanager
    def reference(self) -> Iterator[PackedLM]:
        """The frozen KL reference, for the duration of the block: the policy
        with its adapters off (LoRA), or the separate frozen copy."""
        if self.lora:
            with adapters_off(self.model):
                yield self.lm
            return
        if self._reference_lm is None:
            raise RuntimeError("this policy was loaded without a reference (grpo.beta = 0 needs none)")
        yield self._reference_lm

    # ------------------------------------------------------------ weights out

    def rollout_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs of the plain model under the transformers
        names, streamed so that a caller never needs all full tensors at once:
        what every weight swap into the engine and every export reads.

        FSDP shards are gathered one parameter at a time (a collective: every
        rank walks the parameters in the same order and consumes the stream);
        a LoRA model is folded on the way (W + delta per layer, trained token
        rows in place; rcgrpo.model.lora.merged_weights). Master tensors are fp32;
        the consumer casts to what it stores."""
        own = ((name, distributed.full_tensor(p.detach())) for name, p in self.model.named_parameters())
        if self.lora:
            yield from merged_weights(self.model, own)
        else:
            yield from own

    def export(self, folder: Path, dtype: torch.dtype) -> None:
        """The plain model (safetensors in `dtype`, config.json saying so) in
        `folder`, loadable by transformers and vLLM; a LoRA policy adds its
        adapter alone (peft format, relative to the stage's starting model) in
        `folder/adapter`. Every rank calls (the gather is collective); rank 0
        writes. The tensors are copied to host memory: a 7B state dict beside
        the training model would not fit on the GPU."""
        main = distributed.is_main()
        state = {name: t.to("cpu", dtype) for name, t in self.rollout_weights() if main}
        if not main:
            return
        folder = Path(folder)
        self._plain_model(self.model).save_pretrained(folder, state_dict=state, safe_serialization=True)
        # save_pretrained writes the model's own dtype; the file holds `dtype`.
        config = json.loads((folder / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if self.lora:
            self.model.save_pretrained(folder / ADAPTER_DIR, safe_serialization=True)

    # ------------------------------------------------------------ checkpoints

    def checkpoint_states(self, optimizer: torch.optim.Optimizer) -> dict:
        """Extra arguments of `checkpoint.save_checkpoint` (every rank calls):
        under FSDP the full model and optimizer states gathered on rank 0, in
        the one-process format; otherwise none (the model saves itself: the
        full fp32 model, or a LoRA model's adapter only)."""
        if not self.sharded:
            return {}
        # Sharded runs only: torch.distributed.checkpoint adds ~0.6 s to every start.
        from rcgrpo.model.sharded_state import gathered_model_state, gathered_optimizer_state

        return {"model_state_dict": gathered_model_state(self.model),
                "optimizer_state_dict": gathered_optimizer_state(self.model, optimizer)}

    def restore(self, ckpt, optimizer, scheduler):
        """Weights, optimizer, scheduler and RNG streams from `ckpt` (a
        verified Checkpoint, on rank 0 under torchrun; None: nothing to
        restore). Returns the checkpoint (path, step) or None."""
        if self.sharded:
            from rcgrpo.model.sharded_state import restore_sharded  # as in checkpoint_states

            restored = restore_sharded(ckpt, self.model, optimizer, scheduler)
            self.equals_reference = self.equals_reference and restored is None
            return restored
        if ckpt is None:
            return None
        self.equals_reference = False
        holds_adapter = (ckpt.model_dir / ADAPTER_CONFIG).is_file()
        if holds_adapter != self.lora:
            raise CheckpointError(
                f"{ckpt.model_dir} holds {'LoRA adapter' if holds_adapter else 'full model'} weights but the "
                f"policy {'has' if self.lora else 'has no'} LoRA adapters: resume with the setting the run was "
                f"saved with, model.lora.enabled {str(holds_adapter).lower()}")
        if self.lora:
            try:
                load_adapter(self.model, ckpt.model_dir)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{ckpt.model_dir}: {e}") from e
        else:
            load_model_weights(self.model, ckpt.model_dir)
        return ckpt.restore(optimizer=optimizer, scheduler=scheduler)
