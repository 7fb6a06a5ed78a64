"""Every Triton entry kernel compiles for sm_90 (H100/H200) and sm_80 (A100)
in every dtype and tile config it launches with, without register spills
and inside the target's shared memory; the tiled matmul kernels use the
tensor cores (wgmma on sm_90, mma on sm_80; fp32 as tf32x3 tensor-core
products). No GPU needed: ``aot_compile.py`` traces the launches and compiles
ahead of time (see its docstring). The resource table is printed in the
terminal summary (and with -s right here)."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from kernels_testlib import COMPILE_TABLE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TILED = ("_partials_kernel", "_dlogits_kernel")  # the kernels built on tl.dot

# The triton wheel ships the NVIDIA backend (ptxas, cuobjdump); without it
# the install is broken, so this import fails the suite rather than skip.
import triton.backends.nvidia  # noqa: E402,F401

pytestmark = pytest.mark.slow  # compiles every Triton kernel ahead of time for two GPU targets (~49 s)


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)
    with tempfile.TemporaryDirectory() as tmp:
        env["TRITON_CACHE_DIR"] = tmp  # a cold cache: every variant really compiles
        out = Path(tmp) / "aot.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(HERE / "aot_compile.py"), str(out)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-6000:]
        result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def table(result) -> str:
    rows = sorted(result["variants"], key=lambda r: (r["kernel"], r["target"], r["dtype"], r["tiles"], r["flags"]))
    head = (f"{'kernel':44} {'target':6} {'dtype':5} {'tiles':15} {'w':>2} {'s':>2} {'flags':26} "
            f"{'regs':>4} {'spill':>5} {'smem_KiB':>8} {'mma':6}")
    lines = ["", f"Triton kernels compiled ahead of time: {len(rows)} variants in {result['wall_s']:.1f} s "
             f"(spill = stack + local bytes per thread; smem = dynamic shared memory)", head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['kernel']:44} {r['target']:6} {r['dtype']:5} {r['tiles']:15} ERROR {r['error']}")
            continue
        mma = "wgmma" if r["wgmma"] else ("mma" if r["mma"] else "-")
        mma += ("/tf32x3" if "tf32x3" in r["dot_precision"] else "/tf32") if r["tf32_mma"] else ""
        lines.append(f"{r['kernel']:44} {r['target']:6} {r['dtype']:5} {r['tiles']:15} {r['warps']:>2} "
                     f"{r['stages']:>2} {r['flags'][:26]:26} {r['regs']:>4} {r['spill']:>5} "
                     f"{r['smem'] / 1024:>8.1f} {mma:12}")
    return "\n".join(lines)


def test_every_kernel_compiles_for_hopper_and_ampere(compiled, request):
    request.config.stash[COMPILE_TABLE] = table(compiled)  # printed by conftest's terminal summary

    assert compiled["entries"], "no @triton.jit entry kernel found under rcgrpo_kernels/triton"
    assert not compiled["never_launched"], (
        f"entry kernels no public function launched in the traced workload: {compiled['never_launched']}; "
        "extend aot_compile.run_workload")
    variants = compiled["variants"]
    errors = [f"{r['kernel']} {r['target']} {r['dtype']} {r['tiles']}: {r['error']}" for r in variants if "error" in r]
    assert not errors, "\n".join(errors)
    for entry in compiled["entries"]:
        for target in ("sm_90", "sm_80"):
            assert any(r["kernel"] == entry and r["target"] == target for r in variants), (entry, target)
    for dtype in ("fp32", "bf16", "fp16"):
        assert any(r["kernel"].endswith(TILED) and r["dtype"] == dtype for r in variants), dtype

    spills = [r for r in variants if r["spill"]]
    assert not spills, "register spills: " + "; ".join(
        f"{r['kernel']} {r['target']} {r['dtype']} {r['tiles']} w{r['warps']} {r['flags']}: {r['spill']} B"
        for r in spills)
    over = [r for r in variants if r["smem"] > compiled["smem_limit"][r["target"]]]
    assert not over, [(r["kernel"], r["target"], r["tiles"], r["smem"]) for r in over]
    for r in variants:
        if r["kernel"].endswith(TILED):
            where = f"{r['kernel']} {r['target']} {r['dtype']} {r['tiles']}"
            assert r["wgmma"] if r["target"] == "sm_90" else r["mma"], f"{where}: no tensor-core instructions"
            assert r["tf32_mma"] == (r["dtype"] == "fp32"), f"{where}: fp32 must run as tf32 mma, others not"
            if r["dtype"] == "fp32":  # three tf32 products per fp32 one, not a single rounded one
                assert r["dot_precision"] == ["tf32x3"], f"{where}: dots {r['dot_precision']}"
