"""The engine protocol on plain `transformers.generate`, for machines without vLLM.

Slower (no paged KV cache, padded batches), but it shares the trainer's model
object, so a weight "swap" is a copy into the same parameters.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from rcgrpo.rollout.engine import Generation, SamplingConfig, per_prompt, strip_wrapper_prefixes


class HFEngine:
    name = "hf"
    supports_sleep = False

    def __init__(self, model, tokenizer, *, max_batch_size: int = 4):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id]
        self.eos_token_ids = set(eos)
        self.last_swap_seconds: float | None = None

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig | Sequence[SamplingConfig],
    ) -> list[list[Generation]]:
        configs = per_prompt(sampling, len(prompts))
        results: list[list[Generation]] = [[] for _ in prompts]
        # One generate() call per distinct sampling config (seed aside): HF
        # applies one set of sampling settings to a whole batch.
        groups: dict[SamplingConfig, list[int]] = {}
        for i, c in enumerate(configs):
            key = SamplingConfig(**{**c.__dict__, "seed": None})
            groups.setdefault(key, []).append(i)
        for key, idx in groups.items():
            rows = [(i, k) for i in idx for k in range(key.n)]
            # HF draws a whole batch from one RNG: the group is seeded by its
            # first request's seed (reproducible, but not per request as in vLLM).
            seed = configs[idx[0]].seed
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start : start + self.max_batch_size]
                gens = self._generate_batch([prompts[i] for i, _ in chunk], key, seed)
                for (i, _), g in zip(chunk, gens):
                    results[i].append(g)
        return results

    def _generate_batch(self, prompts, s: SamplingConfig, seed: int | None) -> list[Generation]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        # Left padding keeps every prompt's last token at the same column, so
        # new tokens are appended in lockstep.
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[r, width - len(p) :] = 1
        stop = sorted(self.eos_token_ids | set(s.stop_token_ids))
        greedy = s.temperature == 0
        kwargs = dict(
            max_new_tokens=s.max_tokens,
            do_sample=not greedy,
            eos_token_id=stop,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_scores=s.logprobs,
        )
        if not greedy:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else None)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        # HF samples from the global RNG; fork it so a seed does not leak into
        # the caller's random state.
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        new = out.sequences[:, width:].cpu()
        logps = None
        if s.logprobs and out.scores:
            # scores are the processed logits (after temperature / top-k / top-p),
            # matching vLLM's processed log-probs.
            scores = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()
            logps = scores.gather(-1, new[:, : scores.shape[1]].unsqueeze(-1)).squeeze(-1)
        gens = []
        for r in range(len(prompts)):
            row = new[r].tolist()
            end = next((t + 1 for t, tok in enumerate(row) if tok in stop), None)
            tokens = row[:end] if end is not None else row
            lp = logps[r, : len(tokens)].tolist() if logps is not None else None
            gens.append(Generation(tokens, lp, "stop" if end is not None else "length"))
        return gens

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        import time

        start = time.perf_counter()
        params = dict(self.model.named_parameters())
        # Tied weights appear once in named_parameters but twice in a state dict.
        aliases = set(self.model.state_dict()) - set(params)
        seen = set()
        for name, t in named_tensors:
            name = strip_wrapper_prefixes(name)
            target = params.get(name)
            if target is None:
                if strict and name not in aliases:
                    raise KeyError(f"unknown parameter {name}")
                continue
            if target.data_ptr() != t.data_ptr():  # the trainer may pass our own tensors
                target.copy_(t)
            seen.add(name)
        if strict and (missing := set(params) - seen):
            raise RuntimeError(f"weight swap left {len(missing)} parameters unloaded, e.g. {sorted(missing)[:3]}")
        self.last_swap_seconds = time.perf_counter() - start

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass
