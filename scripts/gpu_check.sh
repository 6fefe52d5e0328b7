#!/usr/bin/env bash
# The GPU checks of normswap's kernels in one run of at most 7 minutes on one H200, every step
# under a hard time limit and writing its results as it goes (a step cut short keeps them).
#
#   bash scripts/gpu_check.sh                     # results to $OUT if set, else benchmarks/results/gpu/
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh # every step on the CPU at tiny sizes, into a temp dir
#
# Steps and limits (seconds):
#   setup           10  wheels carried in wheels/ or .whl/ (Liger-Kernel, the comparison peer),
#                       installed offline; versions
#   aot             35  every kernel variant compiled for sm_90: registers, spills, load widths
#   tests           80  the kernel, design, patch and fusion tests compiled on the GPU (bf16 in)
#   bench_kernels  100  scripts/bench_kernels.py: bf16 forward at M=32768 with every design side
#                       by side, backward, decode, then M=4096, >2**31 elements, fp16
#   bench_generate 150  scripts/bench_generate.py: GPT-2-small and 1.3B shapes, eager then compiled
# 375 s of limits, about 6.5 minutes with the machine's start. The run never reaches the network.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY="${GPU_CHECK_DRY_RUN:-0}"
if [ "$DRY" != 0 ]; then
    DEST="${OUT:-$(mktemp -d -t gpu-check-dry-XXXXXX)}"
else
    DEST="${OUT:-benchmarks/results/gpu}"
fi
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
    PIP_NO_INDEX=1 TRITON_DEFAULT_FP_FUSION=1

summary="$DEST/summary.txt"
: >"$summary"
step() {  # step NAME SECONDS COMMAND...: run under a time limit, output to $DEST/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$DEST/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start)) limit=$limit" | tee -a "$summary"
}

wheels=$(compgen -G "wheels/*.whl"; compgen -G ".whl/*.whl")
if [ -n "$wheels" ] && [ "$DRY" = 0 ]; then
    # shellcheck disable=SC2086
    timeout 10 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/normswap-site $wheels && export PYTHONPATH="/tmp/normswap-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
{
    [ "$DRY" = 0 ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>/dev/null || echo "liger-kernel not installed (no wheel carried)"
    echo "dry_run=$DRY dest=$DEST"
} >>"$summary" 2>&1

# the new designs and fusions first: a step cut short has tested them
KERNEL_TESTS=(tests/test_kernels_designs.py tests/test_kernels_fusion.py tests/test_patch.py tests/test_kernels.py)
if [ "$DRY" = 0 ]; then
    step aot 35 python3 -m normswap.kernels.aot_check --json "$DEST/aot.json"
    step tests 80 python3 -m pytest -v -p no:cacheprovider -m "not slow" "${KERNEL_TESTS[@]}"
    step bench_kernels 100 python3 scripts/bench_kernels.py --budget-s 90 --out "$DEST/bench_kernels-cuda.json"
    step bench_generate 150 python3 scripts/bench_generate.py --out "$DEST/bench_generate-cuda.json"
else
    step aot 60 python3 -m normswap.kernels.aot_check --limit 6 --jobs 1 --json "$DEST/aot.json"
    step tests 90 python3 -m pytest -v -p no:cacheprovider tests/test_kernels_designs.py \
        -k "dispatch or bench_designs or packs or multirow"
    step bench_kernels 120 python3 scripts/bench_kernels.py --dry-run --budget-s 100 --out "$DEST/bench_kernels-dry-run.json"
    step bench_generate 90 python3 scripts/bench_generate.py --cpu --quick --modes eager,compiled \
        --out "$DEST/bench_generate-cpu-quick.json"
fi
# the test log as JSON (written even when the step was cut: it reads the lines pytest got out)
python3 - "$DEST/tests.log" "$DEST/tests.json" <<'EOF'
import json, re, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
results = [m.groups() for m in (re.match(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", l) for l in lines) if m]
counts = {}
for _, outcome in results:
    counts[outcome] = counts.get(outcome, 0) + 1
json.dump({"counts": counts, "tests": [{"test": t, "outcome": o} for t, o in results]}, open(sys.argv[2], "w"), indent=1)
print("tests:", counts)
EOF
cat "$summary"
