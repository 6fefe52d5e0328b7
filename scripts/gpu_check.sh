#!/usr/bin/env bash
# The GPU checks of normswap's kernels, in one run with a hard time budget per step.
#
#   bash scripts/gpu_check.sh            # results to $OUT, else benchmarks/results/gpu/
#
# Steps: install carried wheels (.whl/, e.g. Liger-Kernel for the comparison), the AOT compile
# check, the kernel and patch tests compiled on the GPU (bf16 included), the kernel benchmark
# (bf16 first) and GPT-2 generation. Every step writes its log or JSON into one folder; a step
# that fails or runs out of time is recorded in summary.txt and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:-benchmarks/results/gpu}"
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/normswap-site .whl/*.whl && export PYTHONPATH="/tmp/normswap-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

summary="$DEST/summary.txt"
: >"$summary"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $DEST/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$DEST/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$summary"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -c "import liger_kernel; print('liger_kernel', liger_kernel.__name__, 'importable')" 2>&1 | tail -1
} >>"$summary" 2>&1

step aot 60 python3 -m normswap.kernels.aot_check
step tests 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_patch.py
step bench_kernels 130 python3 scripts/bench_kernels.py --budget-s 100 --out "$DEST/bench_kernels-cuda.json"
step bench_generate 70 python3 scripts/bench_generate.py --configs gpt2-small --out "$DEST/bench_generate-cuda.json"
cat "$summary"
