"""Compile every Triton entry kernel of ``rcgrpo_kernels/triton/`` for real GPUs, on
a machine without one, and read each compiled variant's resource usage.

Run as a script in a fresh process (Triton must not be in interpreter mode):
    python tests/kernels/aot_compile.py OUT.json
``tests/kernels/test_kernels_compile.py`` does, and checks the result.

How the variants are found, so that a kernel added or changed later is
covered without editing this file:
1. Every module under ``rcgrpo_kernels/triton/`` is imported and every
   ``@triton.jit`` function in it is collected; the *entry* kernels are those
   that no other jit function calls.
2. The family modules' public functions run on small CPU tensors (forward and
   backward, fp32 / bf16 / fp16, with and without their optional inputs),
   with ``JITFunction.run`` replaced by a recorder: the host code plans every
   launch exactly as on a GPU (tile sizes, splits, flags) but nothing runs.
   Each ``Tuner`` (and any ``triton.autotune``) is walked through every config.
   The vocabulary is the production one (V = 151,936) so that size-derived
   tile widths are the production ones; H = 16 has the divisibility of
   H = 896, 3,584 and 4,096 (multiples of 16), which is all Triton
   specialises a runtime int on, so the compiled code is theirs.
3. Each distinct launch is bound with Triton's own argument specialisation
   (the same code ``JITFunction.run`` uses: dtypes, 16-byte alignment and
   divisibility hints) for each target and compiled with ``triton.compile``;
   ``cuobjdump --dump-resource-usage`` on the cubin gives registers, stack and
   local memory (spills), the compile metadata gives shared memory.
It follows Triton 3.9's ``JITFunction.run``; a Triton that moves those
internals fails here loudly rather than silently checking less.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"sm_90": 90, "sm_80": 80}  # H100/H200, A100
SMEM_LIMIT = {"sm_90": 232_448, "sm_80": 166_912}  # max dynamic shared memory per block (bytes)
VOCAB = 151_936
HDIM = 16
PRODUCTION_H = (896, 3584, 4096)


def jit_functions():
    """{module.name: JITFunction} for every jit function of rcgrpo_kernels/triton."""
    from triton.runtime.jit import JITFunction

    found = {}
    for short, mod in _modules():
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.module == mod.__name__:
                found[f"{short}.{name}"] = obj
    return found


def entry_kernels(jits):
    """The jit functions no other jit function calls (helpers are inlined)."""
    called = set()
    for fn in jits.values():
        called |= set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", fn.src)) - {fn.__name__}
    return {q: fn for q, fn in jits.items() if fn.__name__ not in called}


class Recorder:
    """Stands in for JITFunction.run / Autotuner.run while the workload runs."""

    def __init__(self):
        self.launches = {}  # dedup key -> (fn, args, kwargs)

    def record(self, fn, args, kwargs):
        """Keep one launch per distinct compiled variant: constexprs and
        options by value, runtime arguments by what Triton specialises on."""
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        const = {p.name for p in fn.params if p.is_constexpr}
        names = [p.name for p in fn.params]
        desc = lambda name, v: repr(v) if name in const or name not in names else _describe(v)  # noqa: E731
        key = (id(fn), tuple(desc(n, a) for n, a in zip(names, args)),
               tuple(sorted((k, desc(k, v)) for k, v in kwargs.items())))
        self.launches.setdefault(key, (fn, args, kwargs))

    def __enter__(self):
        from triton.runtime import autotuner, jit

        self._saved = jit.JITFunction.run, autotuner.Autotuner.run
        rec = self

        def jit_run(fn, *args, grid, warmup, **kwargs):
            rec.record(fn, args, kwargs)

        def autotune_run(tuner, *args, **kwargs):
            for cfg in tuner.configs:
                rec.record(tuner.fn, args, {**kwargs, **cfg.all_kwargs()})

        jit.JITFunction.run, autotuner.Autotuner.run = jit_run, autotune_run
        return self

    def __exit__(self, *exc):
        from triton.runtime import autotuner, jit

        jit.JITFunction.run, autotuner.Autotuner.run = self._saved


def _describe(v):
    import torch

    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), v.data_ptr() % 16 == 0)
    if isinstance(v, int) and not isinstance(v, bool):
        return ("int", v == 1, v % 16 == 0, v.bit_length() > 31)
    return (type(v).__name__, repr(v))


def _with_optional(fn, **optional):
    """The optional keyword inputs that ``fn`` accepts (None for those it lacks)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in optional.items() if k in params}


def run_workload(first_round: bool = True):
    """Every public function of the kernel families, forward and backward.
    ``first_round``: also the rare variants (an lm_head bias, which the
    trainer's packed losses refuse anyway), compiled for the first config of
    each kind only, which keeps the test inside its time budget."""
    import torch

    from rcgrpo_kernels.loss_settings import LossSettings
    from rcgrpo_kernels.objective import Objective
    from rcgrpo_kernels.triton import advantage, fused_linear_grpo_loss, fused_linear_logprob, logprob, loss

    torch.manual_seed(0)
    seqlens = [9, 0, 23, 1, 17]
    n, s = sum(seqlens), len(seqlens)
    cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int32)
    mask = torch.rand(n) < 0.6
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(n, VOCAB, dtype=dtype, requires_grad=True)
        targets = torch.randint(0, VOCAB, (n,))
        logprob.token_logprobs(logits, targets, 0.9).sum().backward()

        rewards = torch.randn(s, dtype=dtype, requires_grad=True)
        groups = torch.tensor([0, 0, 1, 1, 1])
        for estimator in ("grpo", "dr_grpo"):  # with and without the std (the others differ in run-time scalars)
            advantage.group_advantages(rewards, groups, 1e-6, estimator).sum().backward()

        adv = torch.randn(s)
        lp = torch.randn(n, dtype=dtype, requires_grad=True)
        old, ref = torch.randn(n), torch.randn(n)
        # the third call: truncated IS weights and the dual clip (a constexpr)
        tw = _with_optional(loss.grpo_loss, token_weights=torch.rand(n), clip_ratio_c=3.0)
        for o, r, extra in ((None, None, {}), (old, ref, {}), (old, ref, tw)):
            out, _ = loss.grpo_loss(lp, o, r, adv, mask, cu, 0.2, 0.2, 0.04 if r is not None else 0.0,
                                    "grpo", **extra)
            out.backward()

        hidden = torch.randn(n, HDIM, dtype=dtype, requires_grad=True)
        weight = torch.randn(VOCAB, HDIM, dtype=dtype, requires_grad=True)
        bias = torch.randn(VOCAB, dtype=dtype, requires_grad=True)
        # an lm_head bias is rare (Qwen, Llama have none): its variants in bf16 only
        biases = (None, bias) if dtype == torch.bfloat16 and first_round else (None,)
        for b in biases:
            fused_linear_logprob.fused_linear_logprobs(hidden, weight, targets, 0.9, b).sum().backward()
        # the third call: truncated IS weights and the dual clip, as above
        for o, r, b, ent, tokw, clip_c in ((None, None, None, False, None, None), (old, ref, None, True, None, None),
                                           (old, ref, biases[-1], False, torch.rand(n), 3.0)):
            objective = Objective(0.2, 0.28, 0.04 if r is not None else 0.0, clip_ratio_c=clip_c)
            out, _ = fused_linear_grpo_loss.fused_linear_grpo_loss(
                hidden, weight, targets, adv, mask, cu, o, r, b, tokw,
                settings=LossSettings(objective, "grpo", temperature=1.0, compute_entropy=ent))
            out.backward()


def tuners():
    """Every Tuner the kernel modules hold (once each, wherever imported)."""
    from rcgrpo_kernels.triton.common import Tuner

    found = {}
    for _, mod in _modules():
        found.update({id(obj): obj for obj in vars(mod).values() if isinstance(obj, Tuner)})
    return list(found.values())


def _modules():
    import rcgrpo_kernels.triton as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        yield info.name, importlib.import_module(f"rcgrpo_kernels.triton.{info.name}")


def record_launches():
    all_tuners = tuners()
    rounds = max((len(c) for t in all_tuners for c in t.configs.values()), default=1)
    with Recorder() as rec:
        for i in range(rounds):
            for t in all_tuners:
                t.forced = i  # each kind's i-th config
            try:
                run_workload(first_round=i == 0)
            finally:
                for t in all_tuners:
                    t.forced = None
    return list(rec.launches.values())


def _dtype_label(signature):
    ptrs = {v for v in signature.values() if isinstance(v, str) and v.startswith("*")}
    for label in ("bf16", "fp16"):
        if f"*{label}" in ptrs:
            return label
    return "fp32"


def _tiles(constexprs, fn):
    names = {fn.arg_names[k[0]]: v for k, v in constexprs.items()}
    return " ".join(f"{k.replace('BLOCK_', '')}{v}" for k, v in names.items() if k.startswith("BLOCK"))


def _flags(constexprs, fn):
    names = {fn.arg_names[k[0]]: v for k, v in constexprs.items()}
    on = [k for k, v in names.items() if v is True]
    prec = names.get("PREC")
    return ",".join(on + ([prec] if prec and prec != "tf32" else []))  # "tf32" is a no-op for bf16/fp16 tiles


def resource_usage(cubin: bytes) -> dict:
    from triton.backends.nvidia import compiler as nv

    cuobjdump = Path(nv.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        raise RuntimeError(f"unexpected cuobjdump output:\n{out}")
    reg, stack, shared, local = map(int, m.groups())
    # ptxas puts spilled registers in the stack frame (local memory)
    return dict(regs=reg, spill=stack + local, static_smem=shared)


_WORK: list = []  # what forked compile workers read (by index)


def compile_all(launches, jobs=1):
    """Compile every launch for every target; one row per variant. With
    ``jobs`` > 1, forked worker processes compile side by side (they only
    compile: no torch op runs after the fork)."""
    import multiprocessing

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    work, seen = [], set()
    for sm, cc in TARGETS.items():
        target = GPUTarget("cuda", cc, 32)
        backend = make_backend(target)
        binders = {}
        for fn, args, kwargs in launches:
            if id(fn) not in binders:
                binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, backend)
            bound, spec, opts = binders[id(fn)](*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
            key = (id(fn), sm, repr(signature), repr(constexprs), repr(attrs), repr(sorted(options.__dict__.items())))
            if key not in seen:  # launches that differ only in what Triton ignores compile once
                seen.add(key)
                work.append((sm, target, fn, options, signature, constexprs, attrs))
    _WORK[:] = work
    if jobs <= 1:
        return [_compile_index(i) for i in range(len(work))]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_compile_index, range(len(work)), chunksize=1)


def _compile_index(i):
    return _compile_one(*_WORK[i])


def _compile_one(sm, target, fn, options, signature, constexprs, attrs):
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    row = dict(kernel=f"{fn.module.rsplit('.', 1)[-1]}.{fn.__name__}", target=sm, dtype=_dtype_label(signature),
               tiles=_tiles(constexprs, fn), flags=_flags(constexprs, fn), warps=options.num_warps,
               stages=options.num_stages)
    t0 = time.perf_counter()
    try:
        ck = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    except Exception as e:  # reported per variant; the test fails on it
        row.update(error=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        return row
    row["seconds"] = round(time.perf_counter() - t0, 2)
    row.update(resource_usage(ck.asm["cubin"]))
    row["smem"] = ck.metadata.shared
    ptx = ck.asm["ptx"]
    row["wgmma"] = "wgmma.mma_async" in ptx
    row["mma"] = bool(re.search(r"\bmma\.sync", ptx)) or row["wgmma"]
    row["tf32_mma"] = bool(re.search(r"(wgmma\.mma_async|mma\.sync)\S*\.tf32", ptx))
    row["dot_precision"] = sorted(set(re.findall(r"inputPrecision = (\w+)", ck.asm["ttir"])))
    return row


def check_hint_equivalence():
    """The traced H gets the very specialisation of every production H (and
    of its strides), by Triton's own rule, on each target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    for cc in TARGETS.values():
        backend = make_backend(GPUTarget("cuda", cc, 32))
        spec = lambda v: native_specialize_impl(backend, v, False, True, True)  # noqa: E731
        for h in PRODUCTION_H:
            assert spec(h) == spec(HDIM), f"H={h} specialises as {spec(h)}, the traced H={HDIM} as {spec(HDIM)}"


def main(out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("run without TRITON_INTERPRET: kernels must be JIT functions")
    check_hint_equivalence()
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    jits = jit_functions()
    entries = entry_kernels(jits)
    launches = record_launches()
    rows = compile_all(launches, jobs=int(os.environ.get("KERNELS_COMPILE_JOBS", os.cpu_count() or 1)))
    launched = {f"{fn.module.rsplit('.', 1)[-1]}.{fn.__name__}" for fn, _, _ in launches}
    result = dict(entries=sorted(entries), helpers=sorted(set(jits) - set(entries)),
                  never_launched=sorted(set(entries) - launched), variants=rows,
                  smem_limit=SMEM_LIMIT, seconds=round(time.perf_counter() - t0, 1))
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
