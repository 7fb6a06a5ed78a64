"""vLLM running inside the trainer's process, with in-place weight swaps.

Colocated, so that new weights go from the trainer's tensors straight into the
live model: no checkpoint on disk, no server, no copy through a socket.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Iterable, Iterator, Sequence

import torch

from rcgrpo.rollout.engine import Generation, SamplingConfig, per_prompt, strip_wrapper_prefixes
from rcgrpo.rollout.host_pages import discard

# vLLM logs every engine start, compile and weight load at INFO: about half
# the lines of a run's log file. A run shows vLLM's warnings and errors only,
# unless VLLM_LOGGING_LEVEL (vLLM's own setting) asks for more.
ENGINE_LOG_LEVEL = "WARNING"
# The KV cache a run's engine gets on CPU, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE;
# on a GPU, gpu_memory_utilization sizes it). The memory plan counts it
# (rcgrpo.training.memory_plan), so the trainer passes this and no other figure.
CPU_KV_CACHE_GIB = 2


def quiet_engine_logs() -> None:
    """vLLM's logs at ENGINE_LOG_LEVEL and above, where the user set no level."""
    if os.environ.setdefault("VLLM_LOGGING_LEVEL", ENGINE_LOG_LEVEL) == ENGINE_LOG_LEVEL:
        # vLLM reads the variable when its logger is first imported; where
        # that happened already, the level is set on the logger itself.
        logging.getLogger("vllm").setLevel(ENGINE_LOG_LEVEL)


def hf_to_vllm_name(name: str) -> str:
    """HF parameter name -> the checkpoint name vLLM's load_weights expects.

    vLLM's model classes take checkpoint (HF) names and do their own stacking
    (q/k/v -> qkv_proj, gate/up -> gate_up_proj); what differs is only what
    trainers wrap around the names.
    """
    return strip_wrapper_prefixes(name)


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors so each load_weights call carries ~bucket_bytes.

    One call per parameter pays vLLM's per-call overhead hundreds of times;
    one call for everything materialises a full converted copy at once.
    """
    bucket, size = [], 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int = 8192,
        gpu_memory_utilization: float = 0.5,
        kv_cache_gib: float = CPU_KV_CACHE_GIB,
        enable_sleep_mode: bool | None = None,
        enforce_eager: bool | None = None,
        debug: bool = False,
        bucket_bytes: int = 256 << 20,
        **llm_kwargs,
    ):
        # The live model is only reachable when the engine core runs in this
        # process; a multiprocess engine would hide it behind a socket.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gib))))  # vLLM parses an int
        quiet_engine_logs()
        import vllm

        if dtype == "auto":
            # bf16 decode is ~4x slower than fp32 on CPUs without native bf16.
            dtype = "bfloat16" if on_gpu else "float32"
        if enable_sleep_mode is None:
            enable_sleep_mode = on_gpu  # sleep mode needs the CUDA allocator
        if enforce_eager is None:
            enforce_eager = not on_gpu  # CPU graph compilation costs more than it saves here
        self.debug = debug
        self.bucket_bytes = bucket_bytes
        self.supports_sleep = bool(enable_sleep_mode)
        self._asleep = False
        self._on_gpu = on_gpu
        self.released_kv_bytes = 0  # CPU sleep: KV cache memory returned to the OS by the last sleep()
        if not on_gpu:
            # vLLM's CPU runner crashes ("CPU Generator does not use offset")
            # when a seeded request is prefilled in chunks: it rewinds the
            # request's generator, which CPU generators cannot do. Whole-prompt
            # prefill avoids the rewind; it needs a token budget of a full context.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            llm_kwargs.setdefault("max_num_batched_tokens", max_model_len)
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            enable_prefix_caching=True,
            # Log-probs after temperature: what the trainer recomputes with the
            # same temperature, so old_logp and new logp are comparable.
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.eos_token_ids = self._eos_ids()
        self.last_swap_seconds: float | None = None

    # -- internals reached through vLLM's engine objects ----------------------
    def _runner(self):
        worker = self.llm.llm_engine.model_executor.driver_worker
        worker = getattr(worker, "worker", worker)
        return worker.model_runner

    @property
    def model(self) -> torch.nn.Module:
        return self._runner().model

    @property
    def _model_config(self):
        return self.llm.llm_engine.vllm_config.model_config

    def _eos_ids(self) -> set[int]:
        cfg = self._model_config.hf_config
        eos = getattr(cfg, "eos_token_id", None)
        return set(eos if isinstance(eos, list) else [eos]) - {None}

    # -- generation -----------------------------------------------------------
    def _params(self, s: SamplingConfig):
        from vllm import SamplingParams

        return SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_tokens,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            logprobs=0 if s.logprobs else None,  # 0: the sampled token's only
            skip_special_tokens=False,
            detokenize=False,  # the caller decodes; text here would be unused work
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig | Sequence[SamplingConfig],
    ) -> list[list[Generation]]:
        if self._asleep:
            raise RuntimeError("engine is asleep: call wake_up() before generate()")
        if not prompts:
            return []
        params = [self._params(s) for s in per_prompt(sampling, len(prompts))]
        inputs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        result = []
        for out in outputs:
            gens = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = None
                if c.logprobs is not None:
                    lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
                gens.append(Generation(ids, lps, "length" if c.finish_reason == "length" else "stop"))
            result.append(gens)
        return result

    # -- weight swap ----------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Push the trainer's parameters into the live model.

        On CPU, vLLM repacks every linear weight into a oneDNN handle and drops
        the plain tensor, so `model.load_weights` alone cannot reach it. vLLM's
        layerwise reload restores each layer to its pre-processing shape, loads
        it, and re-runs the repacking. A tied lm_head is loaded through the
        embedding and never re-processed by that machinery, leaving a stale
        packed copy of the old embedding as the output layer; it is re-processed
        here explicitly.
        """
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        start = time.perf_counter()
        model = self.model
        dtype = self._model_config.dtype
        device = next(p.device for p in model.parameters())
        tied = bool(getattr(self._model_config.hf_config, "tie_word_embeddings", False))
        sources = {}
        wanted = ((hf_to_vllm_name(n), t) for n, t in named_tensors)
        wanted = ((n, t) for n, t in wanted if not (tied and n == "lm_head.weight"))
        loaded: set[str] = set()
        # The layerwise reload warns "Failed to load weights" for layers that
        # have no checkpoint tensor of their own (rotary cache, tied lm_head) on
        # every swap; real omissions are caught by the `missing` check below.
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = reload_log.level
        reload_log.setLevel(logging.ERROR)
        initialize_layerwise_reload(model)
        try:
            for bucket in buckets(wanted, self.bucket_bytes):
                converted = [(n, t.detach().to(device=device, dtype=dtype).contiguous()) for n, t in bucket]
                if self.debug:
                    sources.update(converted)
                loaded |= set(model.load_weights(converted) or ())
        finally:
            finalize_layerwise_reload(model, self._model_config)
            reload_log.setLevel(level)
        lm_head = getattr(model, "lm_head", None)
        if tied and lm_head is not None and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing and strict:
            raise RuntimeError(f"weight swap left {len(missing)} parameters unloaded, e.g. {sorted(missing)[:3]}")
        # Cached KV blocks were computed by the old weights.
        self.llm.reset_prefix_cache()
        if self.debug:
            self.verify_weights(sources)
        self.last_swap_seconds = time.perf_counter() - start

    @torch.no_grad()
    def verify_weights(self, sources: dict[str, torch.Tensor], n_checks: int = 4) -> None:
        """Check a few live tensors against what was pushed (debug mode).

        Plain tensors are compared by checksum. Linear layers whose weight
        lives only inside a packed CPU kernel are probed instead: the layer's
        output on a random input must equal input @ W.T of the pushed W.
        """
        model = self.model
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        modules = dict(model.named_modules())
        layer_names = sorted({n.rsplit(".", 1)[0] for n in sources})
        picks = layer_names[:: max(1, len(layer_names) // n_checks)][:n_checks]
        if getattr(model, "lm_head", None) is not None and "model.embed_tokens" in layer_names:
            picks.append("lm_head")  # the tied output layer, fed by the embedding
        for layer_name in picks:
            expected, vllm_layer = self._expected_weight(layer_name, sources, packed)
            layer = modules.get(vllm_layer)
            if expected is None or layer is None:
                continue
            w, rows = layer.weight, expected.shape[0]
            # A CPU linear computes from its packed copy, not from .weight (the
            # embedding's lookup does read .weight): probe what is computed.
            if hasattr(layer, "cpu_linear") and not vllm_layer.endswith("embed_tokens"):
                x = torch.randn(3, expected.shape[1], dtype=expected.dtype, device=expected.device)
                got = layer.cpu_linear(x, w, None)[:, :rows]
                ok = torch.allclose(got, x @ expected.T, rtol=1e-3, atol=1e-3)
            elif w.shape[1:] == expected.shape[1:] and w.shape[0] >= rows:
                got = w[:rows]  # vLLM pads vocab rows; compare the real ones
                ok = torch.equal(got, expected)
            else:
                continue
            if not ok:
                raise RuntimeError(f"weight swap verification failed for {vllm_layer}")

    @staticmethod
    def _expected_weight(layer_name, sources, packed):
        if layer_name == "lm_head":
            return sources.get("model.embed_tokens.weight"), "lm_head"
        prefix, _, leaf = layer_name.rpartition(".")
        for fused, parts in packed.items():
            if leaf in parts:
                names = [f"{prefix}.{p}.weight" for p in parts]
                if all(n in sources for n in names):
                    return torch.cat([sources[n] for n in names]), f"{prefix}.{fused}"
                return None, None
        return sources.get(f"{layer_name}.weight"), layer_name

    # -- memory between phases ------------------------------------------------
    def sleep(self) -> None:
        """Give the engine's memory back until `wake_up()`: on CUDA vLLM's
        sleep mode (level 1: weights offloaded, KV cache discarded); on CPU,
        where vLLM has no sleep mode, the KV cache's pages are returned to the
        OS in place (`host_pages.discard`) and the weights stay. The cache must
        read as zero when it comes back, as vLLM allocated it: its CPU
        attention weights unwritten slots by 0, so a NaN left in one poisons
        the replies. Freeing and re-allocating the storage gave no such
        guarantee (the allocator may return memory another tensor freed) and
        was the open engine fault of the learning study."""
        if self._asleep:
            return
        if self.supports_sleep:
            self.llm.sleep(level=1)
        elif not self._on_gpu:
            self.released_kv_bytes = sum(discard(st) for st in self._kv_storages())
        else:
            return
        self._asleep = True

    def wake_up(self) -> None:
        if not self._asleep:
            return
        if self.supports_sleep:
            self.llm.wake_up()
        else:
            # Zero pages, made resident only as blocks are written: the cache
            # costs what the rollouts use. Nothing cached survives.
            self.llm.reset_prefix_cache()
        self._asleep = False

    def _kv_storages(self) -> list:
        """The distinct storages behind the runner's KV cache tensors (vLLM
        allocates one buffer and views it per layer)."""
        seen = {}
        for tensor in self._runner().kv_caches:
            storage = tensor.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    def close(self) -> None:
        """Free the engine's model and KV cache now; the engine is unusable after.

        vLLM's engine core gc.freeze()s what it allocates at start-up, so
        dropping the last reference alone frees nothing; its shutdown
        unfreezes those objects (and ends its in-process world group).
        """
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
