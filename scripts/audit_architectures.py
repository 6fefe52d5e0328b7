"""Coverage audit: every transformers model type with a LayerNorm, classified by measurement.

Every model type in transformers' registry (CONFIG_MAPPING) is measured on a tiny model by
``scripts/audit_measure.py`` in a worker process, one type at a time under a time limit (a type
that runs past it, or kills its worker, is "not measured"). The measurements are cached in
``benchmarks/results/architecture_audit.json``; the table in docs/architectures.md and the count
in README.md are generated from that file and from normswap's adapters:

* ``exact``: normswap has an adapter (each is tested for exactness against float64);
* ``refused``: normswap refuses the type with its reason, or every stack of residual blocks
  is measured post-LN (its first block's output does not move when its input moves by c·1);
* ``not yet``: measured pre-LN (by default, or with one of the config's norm switches flipped),
  or not measurable here with the reason, and no adapter yet.

A type whose tiny model has no centring norm (LayerNorm-like: its output ignores a shift by c·1)
is not listed. Usage:

    nice -n 10 python3 scripts/audit_architectures.py               # measure every type (~1 h on 2 cores)
    python3 scripts/audit_architectures.py --types gpt2 bert        # re-measure some, keep the rest
    python3 scripts/audit_architectures.py --resume                 # measure the types the JSON lacks
    python3 scripts/audit_architectures.py --docs-only              # regenerate docs from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "architecture_audit.json"
DOCS, README = ROOT / "docs" / "architectures.md", ROOT / "README.md"
BEGIN, END = "<!-- audit:begin -->", "<!-- audit:end -->"
COUNT_BEGIN, COUNT_END = "<!-- audit-count:begin -->", "<!-- audit-count:end -->"
STATUSES = ("exact", "refused", "not yet")
sys.path.insert(0, str(ROOT / "scripts"))  # audit_measure, beside this file
RESTART_EVERY = 80  # a fresh worker now and then: every modeling module imported stays in memory


class Worker:
    """A process that measures the model types it is sent, one JSON line each."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, "--serve"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
        self.served = 0

    def ask(self, model_type: str, timeout: float) -> dict | None:
        """The type's row, or None when the worker ran past ``timeout`` seconds or died."""
        self.served += 1
        try:
            self.process.stdin.write(model_type + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        return json.loads(line) if line.strip() else None

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def serve() -> None:
    """Worker loop: a model type per line on stdin, its row as one JSON line on stdout.

    Anything the models print goes to stderr, so stdout carries the rows alone."""
    import torch
    from audit_measure import measure

    torch.set_num_threads(1)
    rows = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        model_type = line.strip()
        try:
            row = measure(model_type)
        except Exception as error:  # a row for every type, whatever its classes do
            row = {"model_type": model_type, "error": f"{type(error).__name__}: {error}"[:200]}
        rows.write(json.dumps(row) + "\n")
        rows.flush()


def measure_types(types: list[str], timeout: float, cached: dict[str, dict], save) -> dict[str, dict]:
    """Measure ``types`` one by one (a fresh worker after a failure); ``save`` after each."""
    from audit_measure import source_has_layer_norm

    rows, worker = dict(cached), None
    for number, model_type in enumerate(types, 1):
        if worker is None:
            worker = Worker()
        started = time.monotonic()
        # the first type of a worker also pays for importing torch and transformers
        row = worker.ask(model_type, timeout + (30 if worker.served == 0 else 0))
        if row is None:
            worker.stop()
            worker = None
            row = {"model_type": model_type, "error": f"ran past the {timeout:g} s limit or ended its process",
                   "layer_norm_in_source": source_has_layer_norm(model_type)}
        elif worker.served >= RESTART_EVERY:
            worker.stop()
            worker = None
        row["seconds"] = round(time.monotonic() - started, 1)
        rows[model_type] = row
        print(f"[{number}/{len(types)}] {model_type}: {row.get('shifts', row.get('error', 'no centring norm'))}",
              file=sys.stderr, flush=True)
        save(rows)
    if worker is not None:
        worker.stop()
    return rows


def _near(value: float, target: float) -> bool:
    return abs(value - target) < 0.05


def status(row: dict, adapters, refusals: dict[str, str]) -> tuple[str | None, str]:
    """(status, reason) of one measured row; status None: not listed (no centring norm)."""
    model_type, shifts = row["model_type"], row.get("shifts")
    if model_type in adapters:
        return "exact", "adapter; exact against float64 in the tests"
    if model_type in refusals:
        return "refused", refusals[model_type]
    if "error" in row:
        if row.get("centring_norms") or row.get("layer_norm_in_source"):
            return "not yet", f"not measured: {row['error']}"
        return None, "no LayerNorm in its source"
    if not row.get("centring_norms"):
        return None, "no centring norm"
    if not shifts:
        return "not yet", "not measured: no stack of residual blocks took a [batch, tokens, width] input"
    if all(_near(value, 1) for value in shifts.values()):
        alone = f" (run alone: {', '.join(row['towers'])})" if row.get("towers") else ""
        return "not yet", f"pre-LN by measurement{alone}; no adapter"
    pre_ln = [key for key, found in (row.get("variants") or {}).items()
              if found and all(_near(value, 1) for value in found.values())]
    if pre_ln:
        return "not yet", f"post-LN by default; pre-LN with `{pre_ln[0]}` by measurement; no adapter"
    if all(_near(value, 0) for value in shifts.values()):
        return "refused", "post-LN by measurement: no block's output moves with its input"
    mixed = ", ".join(f"{name} {value}" for name, value in shifts.items())
    return "not yet", f"neither pre- nor post-LN in every stack ({mixed}); no adapter"


def classified(rows: list[dict]) -> list[dict]:
    """The listed rows with their status and reason, in table order."""
    from normswap.architectures import ARCHITECTURES, POST_LN

    out = []
    for row in rows:
        found, reason = status(row, ARCHITECTURES, POST_LN)
        if found is not None:
            out.append({**row, "status": found, "reason": reason})
    return sorted(out, key=lambda row: (STATUSES.index(row["status"]), row["model_type"]))


def count_line(listed: list[dict], audited: int) -> str:
    from normswap.architectures import ARCHITECTURES

    counts = {name: sum(row["status"] == name for row in listed) for name in STATUSES}
    families = len({id(ARCHITECTURES[row["model_type"]]) for row in listed if row["status"] == "exact"})
    unmeasured = sum(row["status"] == "not yet" and row["reason"].startswith("not measured") for row in listed)
    return (f"{counts['exact']} model types ({families} families) convert exactly, {counts['refused']} are refused and "
            f"{counts['not yet']} are not yet supported ({counts['not yet'] - unmeasured} measured pre-LN or mixed, "
            f"{unmeasured} not measured here), of the {len(listed)} that have a LayerNorm among the "
            f"{audited} model types of transformers' registry")


def _shifts_text(row: dict) -> str:
    shifts = row.get("shifts")
    if not shifts:
        return "–"
    values = sorted(set(shifts.values()))
    return ", ".join(f"{value:g}" for value in values)


def table(results: dict) -> str:
    listed = classified(results["rows"])
    lines = [count_line(listed, len(results["rows"])) + f" (transformers {results['transformers']}; "
             "generated by `python3 scripts/audit_architectures.py` from "
             "`benchmarks/results/architecture_audit.json`).", "",
             "| model type | status | shift | reason |", "|---|---|---|---|"]
    for row in listed:
        reason = row["reason"].replace("|", "\\|")
        lines.append(f"| {row['model_type']} | {row['status']} | {_shifts_text(row)} | {reason} |")
    return "\n".join(lines)


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"markers {begin} … {end} are missing")
    return text[:text.index(begin) + len(begin)] + "\n" + body + "\n" + text[text.index(end):]


def write_docs(results: dict) -> None:
    DOCS.write_text(replace_between(DOCS.read_text(encoding="utf-8"), BEGIN, END, table(results)), encoding="utf-8")
    listed = classified(results["rows"])
    line = count_line(listed, len(results["rows"])) + "."
    README.write_text(replace_between(README.read_text(encoding="utf-8"), COUNT_BEGIN, COUNT_END, line),
                      encoding="utf-8")


def load_results(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="*", help="model types to (re)measure (default: every registered type)")
    parser.add_argument("--resume", action="store_true", help="measure only the types the JSON lacks")
    parser.add_argument("--docs-only", action="store_true", help="regenerate the docs from the JSON; measure nothing")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds one type may take (default 90)")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"the cached results (default {RESULTS})")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the worker process
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    if not args.docs_only:
        import torch
        import transformers
        from transformers import CONFIG_MAPPING

        registry = sorted(name for name in CONFIG_MAPPING.keys() if not name.startswith("normswap_"))
        previous = load_results(args.json) if args.json.exists() else {}
        same = previous.get("transformers") == transformers.__version__
        cached = {row["model_type"]: row for row in previous.get("rows", [])} if same else {}
        types = args.types or [t for t in registry if not (args.resume and t in cached)]
        header = {"transformers": transformers.__version__, "torch": torch.__version__, "timeout_s": args.timeout,
                  "command": "nice -n 10 python3 scripts/audit_architectures.py"}

        def save(rows: dict[str, dict]) -> None:
            kept = [rows[name] for name in registry if name in rows]
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({**header, "rows": kept}, indent=1) + "\n", encoding="utf-8")
        measure_types(types, args.timeout, cached, save)
    write_docs(load_results(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
