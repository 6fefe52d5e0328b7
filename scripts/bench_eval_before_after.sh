#!/usr/bin/env bash
# Time `normswap eval` of the bundled model (converted) against its original on the local tasks,
# for this tree and an older one (e.g. `git archive <commit> | tar -x -C DIR`), each after a
# `python -c "import torch"` yardstick, one after the other. Prints one line per step and writes
# benchmarks/results/bench_eval_before_after.json.
#   scripts/bench_eval_before_after.sh OLDER_TREE [WORKDIR]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
before="$(cd "$1" && pwd)"
work="${2:-$(mktemp -d)}"
cd "$work"
[ -d austen-rms ] || PYTHONPATH="$here" python3 -m normswap convert normswap:austen-gpt2 --out austen-rms --quiet >/dev/null
lines=()
for tree in "$here" "$before"; do
  for cmd in "python3 -c 'import torch'" \
             "python3 -m normswap eval austen-rms --baseline normswap:austen-gpt2 --tasks local --no-progress"; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    s=$(date +%s.%N); rc=0; PYTHONPATH="$tree" bash -c "$cmd" >/dev/null 2>&1 || rc=$?; e=$(date +%s.%N)
    line="$tree | $cmd | rc=$rc | $(echo "$e - $s" | bc) s | load $load"
    echo "$line"; lines+=("$line")
  done
done
printf '%s\n' "${lines[@]}" | python3 "$here/scripts/bench_eval_before_after.py" "$here" > "$here/benchmarks/results/bench_eval_before_after.json"
