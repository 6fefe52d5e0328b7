"""Turn the lines printed by bench_eval_before_after.sh (stdin) into JSON with ratios (stdout)."""

from __future__ import annotations

import json
import sys


def main() -> int:
    here = sys.argv[1]
    steps = []
    for line in sys.stdin.read().splitlines():
        tree, command, rc, seconds, load = (part.strip() for part in line.split(" | "))
        steps.append({"tree": "this" if tree == here else tree, "command": command, "returncode": int(rc[3:]),
                      "seconds": round(float(seconds.split()[0]), 2), "load_before": float(load.split()[1])})
    result = {"steps": steps}
    for tree in ("this", *sorted({s["tree"] for s in steps} - {"this"})):
        own = [s for s in steps if s["tree"] == tree]
        torch_s = next(s["seconds"] for s in own if "import torch" in s["command"])
        eval_s = next(s["seconds"] for s in own if "eval" in s["command"])
        result[f"eval_over_import_torch[{tree}]"] = round(eval_s / torch_s, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
