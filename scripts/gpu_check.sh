#!/usr/bin/env bash
# The GPU checks of normswap's kernels in one run, each step under a hard time limit.
#
#   bash scripts/gpu_check.sh      # results to $OUT if set, else benchmarks/results/gpu/
#
# 1. installs the wheels in .whl/ if any (Liger-Kernel, for the comparison; see docs/kernels.md);
# 2. the AOT check: every kernel variant compiled for sm_90, registers, spills and shared memory
#    per variant (fails on spills);
# 3. the kernel and patch tests, compiled on the GPU (bf16 included);
# 4. scripts/bench_kernels.py: forward, backward, decode and >2**31-element sections, bf16 first;
# 5. scripts/bench_generate.py: GPT-2 small prefill and decode, original against converted and
#    patched.
# The step limits add up to 6.5 minutes (about 7 on an H200 with its start). Every step writes
# its log or JSON into one folder; a step that fails or runs out of time is recorded in
# summary.txt and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:-benchmarks/results/gpu}"
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRITON_DEFAULT_FP_FUSION=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/normswap-site .whl/*.whl && export PYTHONPATH="/tmp/normswap-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

summary="$DEST/summary.txt"
: >"$summary"
step() {  # step NAME SECONDS COMMAND...: run under a time limit, output to $DEST/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$DEST/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$summary"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>&1 | tail -1
} >>"$summary" 2>&1

step aot 40 python3 -m normswap.kernels.aot_check --json "$DEST/aot.json"
step tests 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_patch.py
step bench_kernels 160 python3 scripts/bench_kernels.py --budget-s 140 --out "$DEST/bench_kernels-cuda.json"
step bench_generate 90 python3 scripts/bench_generate.py --configs gpt2-small --out "$DEST/bench_generate-cuda.json"
cat "$summary"
