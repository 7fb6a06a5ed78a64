#!/usr/bin/env bash
# GPU check for the kernels package, for a CUDA machine (sized for one H200, < 8 min):
#   1. make sure the venv has a CUDA torch, triton, liger-kernel and pytest-benchmark
#      (pip install -e ".[gpu,dev]"; if the gpu extra cannot be installed from
#      binary wheels, e.g. flash-attn without a matching wheel, fall back to ".[dev]",
#      which is all the kernel check needs);
#   2. run tests/kernels with the Triton path on CUDA (no interpreter);
#   3. run the CUDA section of benchmarks/test_kernels.py (targets asserted there);
#   4. print one summary table.
# Usage: scripts/gpu_check.sh   (or: make gpu-check). Env: VENV (default .venv), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
PY="$VENV/bin/python"
OUT=.benchmarks/gpu_check
mkdir -p "$OUT"
start=$(date +%s)

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU visible (nvidia-smi failed)" >&2
    exit 2
fi
nvidia-smi -L

ready() {
    "$PY" - <<'PY' 2>/dev/null
import torch, triton, liger_kernel, pytest_benchmark, kernels  # noqa: F401
assert torch.cuda.is_available()
PY
}

[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
if ! ready; then
    echo "== installing (.[gpu,dev], binary wheels only for flash-attn)"
    # A torch CPU build left from `make EXTRAS=cpu,dev` cannot drive the GPU: let pip replace it.
    if "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)' 2>/dev/null; then
        "$PY" -m pip uninstall -y -q torch
    fi
    "$PY" -m pip install -q --only-binary flash-attn -e ".[gpu,dev]" \
        || { echo "== .[gpu,dev] failed; installing .[dev] (enough for the kernel check)"; \
             "$PY" -m pip install -q -e ".[dev]"; }
    ready || { echo "gpu-check: environment still lacks CUDA torch / triton / liger-kernel" >&2; exit 2; }
fi
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())'

echo "== tests/kernels on CUDA"
# One tile config per shape: these are correctness tests on tiny shapes.
env -u TRITON_INTERPRET KERNELS_AUTOTUNE=0 timeout 240 "$PY" -m pytest tests/kernels -q -p no:cacheprovider \
    --junitxml="$OUT/tests.xml"
tests_rc=$?

echo "== benchmarks (CUDA section)"
rm -f .benchmarks/kernels_summary.json
env -u TRITON_INTERPRET timeout 330 "$PY" -m pytest benchmarks/test_kernels.py --benchmark-only -q \
    -p no:cacheprovider -k cuda --benchmark-json="$OUT/bench.json" --junitxml="$OUT/bench.xml"
bench_rc=$?

echo "== summary"
"$PY" - "$OUT" "$tests_rc" "$bench_rc" "$(( $(date +%s) - start ))" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, bench_rc, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def counts(xml):
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return "no report (timed out or crashed?)"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    a = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    s = f"{a['tests'] - a['failures'] - a['errors'] - a['skipped']} passed, {a['failures']} failed, {a['errors']} errors, {a['skipped']} skipped"
    return s + ("" if not failed else "\n    failed: " + ", ".join(failed[:12]))

print(f"tests/kernels (CUDA): {counts(out / 'tests.xml')}  [rc={tests_rc}]")
print(f"benchmarks  (CUDA): {counts(out / 'bench.xml')}  [rc={bench_rc}]")
rows = json.loads(Path(".benchmarks/kernels_summary.json").read_text()) if Path(".benchmarks/kernels_summary.json").exists() else []
by = {(r["path"], r["shape"], r["n"], r["frac"]): r for r in rows if r["device"] == "cuda"}
print(f"\n{'shape':14} {'N':>6} {'loss%':>5} | " + " | ".join(f"{p:>20}" for p in ("reference", "liger", "liger_triton", "chunked", "triton")) + " | triton speed-up vs ref / best liger, peak vs ref")
for shape, n, frac in sorted({k[1:] for k in by}):
    cells, r = [], {p: by.get((p, shape, n, frac)) for p in ("reference", "liger", "liger_triton", "chunked", "triton")}
    for p in r:
        cells.append(f"{r[p]['time_s'] * 1e3:9.1f}ms {r[p]['peak_gib']:6.2f}GiB" if r[p] else f"{'-':>20}")
    t, ref = r["triton"], r["reference"]
    ligs = [x["time_s"] for x in (r["liger"], r["liger_triton"]) if x]
    note = ""
    if t and ref:
        note = f"{ref['time_s'] / t['time_s']:.2f}x"
        note += f" / {min(ligs) / t['time_s']:.2f}x" if ligs else " / -"
        note += f", {t['peak_gib'] / ref['peak_gib']:.3f}"
    print(f"{shape:14} {n:>6} {int(frac * 100):>5} | " + " | ".join(cells) + " | " + note)
print("\ntargets (V=151936, N=16384, bf16, 25% loss tokens): triton >= 3x reference, >= 1.3x best Liger, peak <= 25% reference")
print(f"elapsed {seconds}s; overall {'PASS' if tests_rc == 0 and bench_rc == 0 else 'FAIL'}")
sys.exit(0 if tests_rc == 0 and bench_rc == 0 else 1)
PY
