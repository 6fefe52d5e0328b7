#!/usr/bin/env bash
# The GPU checks of normswap's kernels in one run of at most 6 minutes on one H200, setup
# included, every step under a hard time limit and writing its JSON as it goes (a step cut short
# keeps what it wrote).
#
#   bash scripts/gpu_check.sh                     # results to $OUT if set, else benchmarks/results/gpu/
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh # every step on the CPU at tiny sizes, into a temp dir
#
# Wheels (the machine has no network): fill the git-ignored wheels/ folder before the run with
#   pip download --no-deps -d wheels liger-kernel==0.8.5 transformers==5.24.0
# (Liger-Kernel, the comparison peer; the transformers release the fusion fingerprints know, as the
# machine's own is older). They are installed offline into /tmp/normswap-site.
#
# Steps in order, and limits (seconds):
#   setup            10  the carried wheels installed offline; versions
#   generate_small   90  scripts/bench_generate.py, GPT-2 small, every mode (eager, compiled,
#                        compiled-kernel), 32 new tokens, 2 rounds
#   bench_kernels    90  scripts/bench_kernels.py --budget-s 80
#   generate_1.3b    90  scripts/bench_generate.py, the 1.3B shape, every mode, 32 new tokens, 1 round
#   tests            60  a kernel test subset (designs, fusion, patch), compiled on the GPU
# 340 s of limits, under 6 minutes with setup. The run never reaches the network.
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

if [ "$DRY" = 0 ]; then
    step generate_small 90 python3 scripts/bench_generate.py --models gpt2-small --new-tokens 32 --rounds 2 \
        --out "$DEST/bench_generate-small-cuda.json"
    step bench_kernels 90 python3 scripts/bench_kernels.py --budget-s 80 --out "$DEST/bench_kernels-cuda.json"
    step generate_1.3b 90 python3 scripts/bench_generate.py --models gpt2-1.3b --new-tokens 32 --rounds 1 \
        --out "$DEST/bench_generate-1.3b-cuda.json"
    step tests 60 python3 -m pytest -v -p no:cacheprovider -m "not slow" tests/test_kernels_designs.py \
        tests/test_kernels_fusion.py tests/test_patch.py
else
    step generate_small 90 python3 scripts/bench_generate.py --quick --new-tokens 2 --rounds 1 \
        --out "$DEST/bench_generate-small-cpu.json"
    step bench_kernels 90 python3 scripts/bench_kernels.py --dry-run --budget-s 80 --out "$DEST/bench_kernels-dry-run.json"
    step generate_1.3b 90 python3 scripts/bench_generate.py --quick --modes eager --new-tokens 2 --rounds 1 \
        --out "$DEST/bench_generate-1.3b-cpu.json"
    step tests 60 python3 -m pytest -v -p no:cacheprovider tests/test_kernels_designs.py \
        -k "dispatch or packs"
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
