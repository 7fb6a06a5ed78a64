#!/usr/bin/env bash
# GPU check (scripts/gpu_check.py says what runs; <= 6 min on an H200), for a
# machine without network: the interpreter already there (PYTHON, default
# python3, with torch, triton, transformers, pytest) plus the wheels carried
# in WHEELS (default .whl; `make gpu-wheels` fetches them where pip works),
# installed offline into a scratch target. The summary JSON goes to
# GPU_CHECK_OUT (default .benchmarks/gpu_check) after every case.
#   make gpu-check          on the GPU machine
#   make gpu-check DRY=1    here: the same steps on CPU through Triton's interpreter, tiny shapes
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
DRY=${DRY:-0}
export GPU_CHECK_OUT=${GPU_CHECK_OUT:-$PWD/.benchmarks/gpu_check}
start=$(date +%s)

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu-check: no wheels in $WHEELS (run 'make gpu-wheels' where pip can reach PyPI)" >&2
    exit 2
fi
SITE=${GPU_CHECK_SITE:-$(mktemp -d)/site}
echo "== installing ${#wheels[@]} carried wheel(s) offline into $SITE"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" || exit 2
# the scratch target first (the carried versions win), then this checkout (rcgrpo_kernels, rcgrpo, benchmarks)
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}

if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    "$PYTHON" scripts/gpu_check.py --dry
else
    unset TRITON_INTERPRET
    nvidia-smi -L 2>/dev/null || echo "gpu-check: nvidia-smi unavailable; relying on torch.cuda" >&2
    "$PYTHON" scripts/gpu_check.py
fi
rc=$?
summary="$GPU_CHECK_OUT/gpu_check_summary.json"
[ -f "$summary" ] || summary="none written"
echo "gpu-check: exit $rc after $(( $(date +%s) - start )) s; summary: $summary"
exit $rc
