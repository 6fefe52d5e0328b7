"""Benchmark the everyday commands side by side: start-up, inspect, eval, run, install sizes.

In one run, each step a fresh process, repeated ``--repeat`` times (min and median reported):

* ``python -c "import torch"`` (the yardstick), ``normswap --help``, ``normswap --version``,
  ``normswap convert /no/such/dir --out X`` (a bad path) and ``normswap convert`` with a bad flag;
  each start-up step also records whether torch or transformers was imported (``-X importtime``);
* ``normswap inspect normswap:austen-gpt2``; with ``--before TREE``, each of these steps also run
  from an older source tree, interleaved, for before/after figures from the same run;
* ``inspect``: ``import torch`` against ``normswap inspect normswap:austen-gpt2`` (text, and
  ``--json --fold-gains``), interleaved (and from ``--before TREE``), for the inspect target;
* ``normswap eval austen-rms --baseline normswap:austen-gpt2 --tasks local`` (the bundled model
  converted once first) and ``normswap run austen-gpt2``, each also with ``--one-at-a-time``
  (normswap's scoring, the two models one after the other) and ``--plain-lm-eval`` (lm-eval's
  own HFLM path, one model at a time), interleaved, with the speed-ups between them;
* ``convert``: for a synthetic fp16 GPT-2 checkpoint (``--convert-sizes``; default the 1.5B one,
  3.1 GB in 4 shards), ``cp`` of its files, the stock class's import (``verify``'s share that is
  transformers' start-up), ``convert --verify none``, ``verify`` alone and the default ``convert``
  (layer-by-layer verification included), with peak RSS (``bench_convert.py``);
* install sizes: the dependency closure of the core and of each extra (from the metadata of the
  distributions installed in this environment), sized from their installed files.

Ratios are printed against ``import torch`` measured in the same run, and everything is written
to ``benchmarks/results/bench_cli.json``. The machine may be shared: the 1-minute load average
before each step is recorded with it.

    python scripts/bench_cli.py                    # everything, 3 runs each
    python scripts/bench_cli.py --only startup     # start-up steps only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_cli.json"
STEPS = ("startup", "inspect", "eval", "run", "convert", "install")
EXTRAS = ("", "eval", "plot", "kernels", "all", "test")
HEAVY = ("torch", "transformers", "lm_eval")
PROJECT_REQUIREMENTS: list[str] = []  # filled from pyproject.toml, for self-referencing extras


def normswap(*args: str) -> list[str]:
    return [sys.executable, "-m", "normswap", *args]


def environment(tree: Path = ROOT) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_once(command: list[str], cwd: Path, importtime: bool = False, tree: Path = ROOT) -> dict:
    """Wall seconds and exit status of one fresh process (and its heavy imports, with ``importtime``)."""
    load = os.getloadavg()[0]
    full = [command[0], "-X", "importtime", *command[1:]] if importtime else command
    started = time.perf_counter()
    result = subprocess.run(full, cwd=cwd, env=environment(tree), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    record = {"seconds": round(seconds, 3), "returncode": result.returncode, "load_before": round(load, 2)}
    if importtime:
        imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
        record["heavy_imports"] = sorted(name for name in HEAVY if name in imported)
        errors = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
        record["stderr"] = errors[-2:]
    else:
        record["stderr"] = result.stderr.strip().splitlines()[-2:]
    return record


def repeated(command: list[str], cwd: Path, repeat: int, importtime: bool = False) -> dict:
    runs = [run_once(command, cwd, importtime) for _ in range(repeat)]
    seconds = [run["seconds"] for run in runs]
    return {"command": " ".join(command[2:] if command[1] == "-m" else command[1:]),
            "min": min(seconds), "median": round(statistics.median(seconds), 3), "runs": runs}


def bench_startup(work: Path, repeat: int, before: Path | None) -> dict:
    return side_by_side({
        "normswap --help": normswap("--help"),
        "normswap --version": normswap("--version"),
        "normswap convert (bad path)": normswap("convert", "/no/such/checkpoint", "--out", str(work / "x")),
        "normswap convert (bad flag)": normswap("convert", "normswap:austen-gpt2", "--no-such-flag"),
        "normswap eval (bad path)": normswap("eval", "/no/such/checkpoint"),
        "normswap inspect normswap:austen-gpt2": normswap("inspect", "normswap:austen-gpt2"),
    }, work, repeat, before)


def bench_inspect(work: Path, repeat: int, before: Path | None) -> dict:
    return side_by_side({
        "normswap inspect normswap:austen-gpt2": normswap("inspect", "normswap:austen-gpt2"),
        "normswap inspect normswap:austen-gpt2 --json --fold-gains": normswap("inspect", "normswap:austen-gpt2",
                                                                               "--json", "--fold-gains"),
    }, work, repeat, before)


def side_by_side(commands: dict[str, list[str]], work: Path, repeat: int, before: Path | None) -> dict:
    """Each command against ``import torch``, interleaved, ``repeat`` times (and from ``before``)."""
    torch_cmd = [sys.executable, "-c", "import torch"]
    steps = {"import torch": (torch_cmd, ROOT)}
    for name, command in commands.items():
        steps[name] = (command, ROOT)
        if before is not None:
            steps[f"{name} [before]"] = (command, before)
    results = {}
    # interleaved, so that a burst of load from elsewhere hits every step alike
    for _ in range(repeat):
        for name, (command, tree) in steps.items():
            results.setdefault(name, []).append(run_once(command, work, command is not torch_cmd, tree))
    out = {}
    for name, runs in results.items():
        seconds = [run["seconds"] for run in runs]
        out[name] = {"min": min(seconds), "median": round(statistics.median(seconds), 3), "runs": runs}
    torch_median = out["import torch"]["median"]
    for figures in out.values():
        figures["over_import_torch"] = round(figures["median"] / torch_median, 3)
    return out


def bench_commands(work: Path, slow_repeat: int, steps: set[str]) -> dict:
    """eval and run, each also with ``--one-at-a-time`` and ``--plain-lm-eval`` (lm-eval's own HFLM
    path), interleaved run by run so that load from elsewhere hits them alike; ``speedup_over_plain``
    is plain median / default median, ``speedup_of_side_by_side`` one-at-a-time median / default median."""
    commands: dict[str, list[str]] = {}
    if "eval" in steps:
        converted = work / "austen-rms"
        if not converted.exists():
            subprocess.run(normswap("convert", "normswap:austen-gpt2", "--out", str(converted), "--quiet"),
                           cwd=work, env=environment(), check=True, capture_output=True)
        commands["eval"] = normswap("eval", "austen-rms", "--baseline", "normswap:austen-gpt2", "--tasks", "local",
                                    "--no-progress")
    if "run" in steps:
        recipe = str(ROOT / "normswap" / "recipes" / "austen-gpt2.yaml")
        commands["run"] = normswap("run", recipe, "--out", str(work / "run"), "--overwrite", "--no-progress")
    variants = {}
    for name, command in commands.items():
        variants[name] = command
        variants[f"{name} (one at a time)"] = [*command, "--one-at-a-time"]
        variants[f"{name} (plain lm-eval)"] = [*command, "--plain-lm-eval"]
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(slow_repeat):
        for name, command in variants.items():
            runs[name].append(run_once(command, work))
    out: dict[str, dict] = {}
    for name, command in variants.items():
        seconds = [run["seconds"] for run in runs[name]]
        out[name] = {"command": " ".join(command[2:]), "min": min(seconds),
                     "median": round(statistics.median(seconds), 3), "runs": runs[name]}
    for name in commands:
        out[name]["speedup_over_plain"] = round(out[f"{name} (plain lm-eval)"]["median"] / out[name]["median"], 3)
        out[name]["speedup_of_side_by_side"] = round(out[f"{name} (one at a time)"]["median"] / out[name]["median"], 3)
    return out


def bench_convert_rows(work: Path, sizes: str, repeat: int) -> dict:
    """cp, conversion without verification, verification alone and the default command, side by
    side per size (``scripts/bench_convert.py``'s rounds, in this run)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_convert

    records = [bench_convert.bench_size(bench_convert.SIZES[name], work, repeat) for name in sizes.split(",")]
    return {"results": records, "targets": bench_convert.targets(records), "table": bench_convert.table(records)}


def installed_bytes(distribution: str) -> int | None:
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        return None
    total = 0
    for file in files:
        path = Path(file.locate())
        if path.is_file():
            total += path.stat().st_size
    return total


def _closure(requirements: list[str], extras: set[str]) -> set[str]:
    """Names of the distributions ``requirements`` pull in, recursively, as installed here."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    pending = [(text, frozenset(extras)) for text in requirements]
    while pending:
        text, active = pending.pop()
        requirement = Requirement(text)
        if requirement.marker is not None and not any(
            requirement.marker.evaluate({**default_environment(), "extra": extra}) for extra in (active or {""})
        ):
            continue
        name = canonicalize_name(requirement.name)
        if name == "normswap":  # a self-reference: normswap[eval] inside normswap[all]
            pending += [(dep, frozenset(requirement.extras)) for dep in PROJECT_REQUIREMENTS]
            continue
        key = name + "[" + ",".join(sorted(requirement.extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        pending += [(dep, frozenset(requirement.extras)) for dep in requires]
    return {key.split("[")[0] for key in seen}


def bench_install() -> dict:
    """Distributions each extra pulls in (the dependency closure, from the metadata of what is
    installed here), and the bytes of their installed files: the size of a fresh environment."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    PROJECT_REQUIREMENTS[:] = core + [f"{dep}; extra == '{extra}'" if ";" not in dep else dep
                                      for extra, deps in optional.items() for dep in deps]
    out = {}
    for extra in EXTRAS:
        names = sorted(_closure(core + (optional.get(extra, []) if extra else []), {extra} if extra else set()))
        sizes = {name: installed_bytes(name) for name in names}
        known = [size for size in sizes.values() if size is not None]
        largest = sorted(((size, name) for name, size in sizes.items() if size), reverse=True)[:5]
        out[extra or "core"] = {
            "distributions": len(names),
            "installed_mb": round(sum(known) / 1e6, 1),
            "not_installed_here": [name for name, size in sizes.items() if size is None],
            "largest_mb": {name: round(size / 1e6, 1) for size, name in largest},
            "has": {name: name in names for name in ("torch", "triton", "lm-eval", "matplotlib", "pandas", "scipy",
                                                     "pyarrow")},
        }
    return out


def table(report: dict) -> str:
    lines = ["| step | min s | median s | × import torch (median) | heavy imports |", "|---|---|---|---|---|"]
    torch_median = report.get("startup", {}).get("import torch", {}).get("median")
    for name, figures in [*report.get("startup", {}).items(), *report.get("inspect", {}).items()]:
        heavy = ", ".join(figures["runs"][0].get("heavy_imports", [])) or "-"
        lines.append(f"| {name} | {figures['min']:.3f} | {figures['median']:.3f} | {figures['over_import_torch']:.3f} "
                     f"| {heavy if name != 'import torch' else 'torch'} |")
    for figures in report.get("commands", {}).values():
        ratio = f"{figures['median'] / torch_median:.2f}" if torch_median else "-"
        lines.append(f"| {figures['command']} | {figures['min']:.2f} | {figures['median']:.2f} | {ratio} | |")
    if "install" in report:
        lines += ["", "| install | distributions | MB installed | torch | triton | lm-eval | matplotlib |",
                  "|---|---|---|---|---|---|---|"]
        for extra, figures in report["install"].items():
            if "error" in figures:
                lines.append(f"| {extra} | error: {figures['error']} | | | | | |")
                continue
            has = figures["has"]
            lines.append(f"| {extra} | {figures['distributions']} | {figures['installed_mb']:.0f} | "
                         + " | ".join("yes" if has[n] else "no" for n in ("torch", "triton", "lm-eval", "matplotlib"))
                         + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated, from {', '.join(STEPS)}")
    parser.add_argument("--repeat", type=int, default=3, help="runs per step (min and median reported)")
    parser.add_argument("--slow-repeat", type=int, default=3, help="runs of eval and run (min and median reported)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results file")
    parser.add_argument("--convert-sizes", default="gpt2-xl", help="checkpoint sizes of the convert step "
                                                                    "(bench_convert.py's names, comma-separated)")
    parser.add_argument("--convert-repeat", type=int, default=3, help="rounds of the convert step")
    parser.add_argument("--before", type=Path, help="an older source tree: its start-up steps are measured "
                                                     "interleaved with this one's (e.g. from git archive)")
    args = parser.parse_args(argv)
    steps = set(args.only.split(","))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="normswap-bench-cli-"))
    report: dict = {}
    try:
        if "startup" in steps:
            report["startup"] = bench_startup(work, args.repeat, args.before)
        if "inspect" in steps:
            report["inspect"] = bench_inspect(work, args.repeat, args.before)
        if steps & {"eval", "run"}:
            report["commands"] = bench_commands(work, args.slow_repeat, steps)
        if "convert" in steps:
            report["convert"] = bench_convert_rows(work, args.convert_sizes, args.convert_repeat)
        if "install" in steps:
            report["install"] = bench_install()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(report))
    if "convert" in report:
        print(report["convert"]["table"])
        print(json.dumps(report["convert"]["targets"], indent=2))
    report = {
        "command": "python scripts/bench_cli.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "note": "shared machine: other processes may have been running; load_before is the 1-minute "
                            "load average before each run"},
        **report,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
