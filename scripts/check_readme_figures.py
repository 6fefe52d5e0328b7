"""Rerun the commands beside the figures in README.md and docs/, and compare what they print with the text.

Every ``Figure`` names a document, a regular expression that finds the figure there (its groups
are the stated numbers), the command printed beside it, and how to read the same numbers from
that command's output. A stated number passes when the printed one, rounded to the stated
precision, is equal to it: ``78.0783`` to 4 decimals, ``-2.717e-04`` to 3 mantissa digits, ``2.93``
(a percentage, the printed share times 100) to 2 decimals. A stated bound (``< 1e-8``) passes
when the printed number's magnitude is below it: the README gives bounds for float32 rounding
noise, whose digits change with the thread count.

The commands run once each, in a temporary folder, with this checkout's normswap; several figures
share one run (the geometry figures measure the checkpoint the recipe run converted). Figures
whose command needs a GPU, the hub's 1.5B model, or measures time are listed in ``SKIPPED`` with
the reason, and printed as skipped.

    python3 scripts/check_readme_figures.py [--only run,geometry,naive,rotate] [--keep DIR]

By default ``run``, ``geometry`` and ``naive`` are rerun (a few minutes on two CPU cores in all);
``rotate`` (scripts/bench_rotate.py --synthetic) takes longer and runs with ``--only rotate``.

Exit status 0 when every figure checked matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NORMSWAP = [sys.executable, "-m", "normswap.cli"]

# name -> the commands it runs (in order, in the temporary folder), as printed beside its figures
COMMANDS: dict[str, list[list[str]]] = {
    "run": [[*NORMSWAP, "run", "austen-gpt2", "--out", "out/run-austen",
             "--no-progress"]],
    # docs/geometry.md's command, on the checkpoint the recipe run converted (out/austen-rms in the text)
    "geometry": [[*NORMSWAP, "geometry", "normswap:austen-gpt2", "--compare", "out/run-austen/converted",
                  "--out", "out/geometry", "--plot", "--no-progress"]],
    "naive": [[*NORMSWAP, "convert", "normswap:austen-gpt2", "--out", "out/naive", "--method", "naive",
               "--allow-inexact", "--no-progress"],
              [*NORMSWAP, "eval", "out/naive", "--baseline", "normswap:austen-gpt2", "--tasks", "local",
               "--no-progress"]],
    "rotate": [[sys.executable, str(ROOT / "scripts" / "bench_rotate.py"), "--synthetic", "--seeds", "0",
                "--eval-tokens", "2048", "--outlier-tokens", "2048", "--out", "out/bench_rotate-synthetic.json", "--plot", "out/bench_rotate-synthetic.png"]],
}
NEEDS = {"geometry": ["run"]}  # geometry reads run's converted checkpoint
# rerun by default; "rotate" (scripts/bench_rotate.py --synthetic) takes minutes on a CPU: --only rotate
DEFAULT = ("run", "geometry", "naive")
# the commands as the documents print them -> the key of COMMANDS that reruns them
PRINTED = {
    "normswap run austen-gpt2 --out out/run-austen": "run",
    "normswap geometry normswap:austen-gpt2 --compare out/austen-rms": "geometry",
    "normswap geometry normswap:austen-gpt2 --compare out/austen-rms --out out/geometry --plot": "geometry",
    "normswap convert normswap:austen-gpt2 --out out/naive --method naive --allow-inexact": "naive",
    "normswap eval out/naive --baseline normswap:austen-gpt2 --tasks local": "naive",
    "python3 scripts/bench_rotate.py --synthetic --seeds 0 --eval-tokens 2048 --outlier-tokens 2048": "rotate",
}


@dataclass(frozen=True)
class Figure:
    doc: str  # path under the repository
    text: str  # regular expression on the document; its groups are the stated numbers
    command: str  # key of COMMANDS
    read: Callable[[str], list]  # the printed numbers (or names), in the order of ``text``'s groups
    below: bool = False  # the stated numbers are bounds written in words ("below 2e-8")


def number(text: str) -> float:
    return float(text.replace("−", "-").replace("–", "-"))


def table_cells(output: str, first: str) -> list[str]:
    """The cells of the Markdown table row of ``output`` whose first cell is ``first``."""
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells[0] == first:
            return cells
    raise LookupError(f"no table row {first!r} in the output")


def per_document_max(output: str, section: str = "Per-document loglikelihood") -> list:
    """The largest "max abs Δ loglik" of the per-document table after ``section``, and its task."""
    rows = output[output.index(section):].split("\n\n", 2)[1].splitlines()[2:]
    cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows if row.startswith("|")]
    worst = max(cells, key=lambda row: float(row[2]))
    return [float(worst[2]), worst[0]]


def geometry_row(output: str, norm: str) -> list[float]:
    """mean|cos| orig, pooled orig, RMS/std orig, naive err orig of one norm in geometry's table."""
    line = next(line for line in output.splitlines() if line.split()[:1] == [f"transformer.{norm}"])
    values = line.split()[-8:]
    return [float(values[i]) for i in (0, 2, 4, 6)]


def geometry_original_range(output: str) -> list[float]:
    shares = [geometry_row(output, norm)[0] for norm in GEOMETRY_NORMS]
    return [100 * min(shares), 100 * max(shares)]


def isotropic_ratios(output: str) -> list[float]:
    """How many times a random direction's share exceeds the largest and the smallest norm's, and that share in %."""
    isotropic = float(re.search(r"random isotropic vector has mean \|cos\| ([\d.]+)", output).group(1))
    low, high = geometry_original_range(output)
    return [100 * isotropic / high, 100 * isotropic / low, 100 * isotropic]


def converted_share_max(output: str) -> list[float]:
    summary = output[output.index("\nconverted:\nmean share"):]
    return [float(re.search(r"largest ([-\d.e+]+) at", summary).group(1))]


def mean_dimensions(output: str) -> list[float]:
    listed = re.search(r"dimensions carrying the mean[^:]*: (.*)", output).group(1)
    return [float(dim) for dim in re.findall(r"(?:^|, )(\d+) \(", listed)]


def naive_verification(output: str) -> list[float]:
    cells = table_cells(output, "remote_code")
    return [float(cells[1]), float(cells[2]), float(cells[3]), float(cells[4]), float(cells[5])]


def strided(output: str) -> list[float]:
    cells = table_cells(output, "strided/token_perplexity")
    return [float(cells[1]), float(cells[2]), float(cells[4])]


def rotate_synthetic(output: str) -> list[float]:
    """The stream readers' largest outlier ratio and kurtosis: the original's, and free Hadamard's."""
    rows = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 2 and all(re.fullmatch(r"[\d.]+ / [\d.]+", c) for c in cells[1:3]):
            rows.setdefault(cells[0], [float(cells[1].split(" / ")[1]), float(cells[2].split(" / ")[1])])
    hadamard = next(values for name, values in rows.items() if name.startswith("free hadamard"))
    return [rows["original"][0], hadamard[0], rows["original"][1], hadamard[1]]


GEOMETRY_NORMS = [f"h.{layer}.ln_{k}" for layer in range(4) for k in (1, 2)] + ["ln_f"]
BUNDLED_ROW = r"strided perplexity (78\.\d+) vs (78\.\d+) \(\\\|relative Δ\\\| (< [\d.e-]+)\)"
NAIVE_README = (r"strided perplexity (78\.\d+) → (78\.\d+) \(relative Δ (−[\d.e-]+)\), yet up to ([\d.]+) nats on one "
                r"document \((\w+)\)")

FIGURES: list[Figure] = [
    Figure("README.md", BUNDLED_ROW, "run", lambda out: strided(out)),
    Figure("README.md", r"largest per-document \\\|Δ loglik\\\| (< [\d.e-]+) nats", "run",
           lambda out: [per_document_max(out)[0]]),
    Figure("README.md", r"built-in verification max \\\|Δlogit\\\| (< [\d.e-]+)", "run",
           lambda out: [max(float(v) for v in re.findall(r"\.max_abs_diff \| ([\d.e+-]+)", out))]),
    Figure("README.md", r"([\d.]+)–([\d.]+) % of each norm input lies along", "geometry", geometry_original_range),
    Figure("README.md", r"below (\d+e-\d+) after conversion", "geometry", converted_share_max, below=True),
    Figure("README.md", NAIVE_README, "naive", lambda out: [*strided(out), *per_document_max(out)]),
    Figure("README.md", r"outlier ratio from ([\d.]+) to ([\d.]+) \(max\) and kurtosis from ([\d.]+) to ([\d.]+)",
           "rotate", rotate_synthetic),
    *[Figure("docs/geometry.md", rf"\| {re.escape(norm)} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|",
             "geometry", lambda out, norm=norm: geometry_row(out, norm)) for norm in GEOMETRY_NORMS],
    Figure("docs/geometry.md", r"mean share is below (\d+e-\d+) at every norm", "geometry", converted_share_max,
           below=True),
    Figure("docs/geometry.md", r"([\d.]+)–([\d.]+)% of each norm input's length", "geometry",
           geometry_original_range),
    Figure("docs/geometry.md", r"spread over dims (\d+), (\d+), (\d+), (\d+), (\d+)\)", "geometry", mean_dimensions),
    Figure("docs/geometry.md", r"max \|Δlogit\| ([\d.]+), mean KL ([\d.e-]+) and top-1 agreement ([\d.]+) on its "
                               r"probe\s+\(probe perplexity ([\d.]+) → ([\d.]+)\)", "naive", naive_verification),
    Figure("docs/geometry.md", r"perplexity\s+(78\.\d+) → (78\.\d+) \(relative Δ (−[\d.e-]+)\)", "naive",
           lambda out: strided(out)),
    Figure("docs/geometry.md", r"up to\s+([\d.]+) nats on one document \((\w+)\)", "naive", per_document_max),
    Figure("docs/geometry.md", r"([\d.]+)–([\d.]+)×\s+less than a random direction would hold in d = 128 "
                               r"\(([\d.]+)%\)", "geometry", isotropic_ratios),
]

# figures with a command beside them that this check does not rerun, and why
SKIPPED: dict[str, str] = {
    "python3 -m pytest -q tests/test_architectures_causal.py tests/test_architectures_encoders.py":
        "a bound the tests assert themselves (the test command runs them)",
    "python3 scripts/bench_cli.py --only convert --convert-sizes gpt2-xl --convert-repeat 5":
        "builds a 3.1 GB synthetic checkpoint and measures time (minutes)",
    "bash scripts/gpu_check.sh": "needs an NVIDIA GPU (figures measured on an H200)",
    "python3 scripts/bench_scale.py --sizes gpt2-xl,opt-6.7b --rounds 2":
        "builds 3.1 and 13.3 GB synthetic checkpoints and measures time (tens of minutes)",
    "python3 scripts/bench_scale.py --sizes gpt2-xl,opt-6.7b,opt-13b --rounds 1":
        "builds 3.1, 13.3 and 25.7 GB synthetic checkpoints (52 GB of disk) and measures time (tens of minutes)",
    "python3 scripts/bench_scale.py --sizes opt-6.7b --rounds 1 --cold":
        "empties the page cache (root) and builds a 13.3 GB synthetic checkpoint (tens of minutes)",
    'python3 -m pytest -q tests/test_rotate_commuting.py -k "generate or lm_eval"':
        "the stock loaders' and lm-eval's agreement is asserted by the tests themselves",
    "python3 scripts/bench_cli.py --only startup,inspect": "timings: they depend on the machine and its load",
    "python3 scripts/bench_kernels.py --host": "timings (host time of a kernel call): they depend on the machine and its load",
    "python3 scripts/bench_cli.py --only eval --slow-repeat 5": "timings: they depend on the machine and its load",
    "python3 scripts/bench_eval_scoring.py": "timings: they depend on the machine and its load",
    "normswap geometry whisper-tiny --compare out/whisper-tiny-rms --audio bundled":
        "the tiny random Whisper it measures is built by the tests, not by a command in the docs",
}


def matches(stated: str, printed: float | str) -> bool:
    """Whether ``printed`` agrees with the ``stated`` text within the precision the text gives
    (a name, such as the task holding the worst document, must be equal)."""
    if isinstance(printed, str):
        return stated == printed
    stated = stated.replace("−", "-").strip()
    if stated.startswith("<"):
        return abs(printed) < number(stated[1:])
    if "e" in stated.lower():
        mantissa = stated.lower().split("e")[0]
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return f"{printed:.{digits}e}" == f"{number(stated):.{digits}e}"
    decimals = len(stated.split(".")[1]) if "." in stated else 0
    return f"{printed:.{decimals}f}" == f"{number(stated):.{decimals}f}"


def run_commands(names: list[str], folder: Path) -> dict[str, str]:
    """Each named command's stdout and stderr, run once, in ``folder``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    outputs: dict[str, str] = {}
    for name in names:
        text = []
        for argv in COMMANDS[name]:
            shown = ["normswap", *argv[3:]] if argv[:3] == NORMSWAP else ["python3", *argv[1:]]
            print(f"$ {' '.join(shown)}", file=sys.stderr, flush=True)
            result = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
            text += [result.stdout, result.stderr]
        outputs[name] = "\n".join(text)
    return outputs


def check(figures: list[Figure], outputs: dict[str, str]) -> list[str]:
    """One line per figure: ``ok`` or ``MISMATCH``/``MISSING`` with the stated and printed numbers."""
    lines = []
    for figure in figures:
        document = (ROOT / figure.doc).read_text(encoding="utf-8")
        found = re.search(figure.text, document)
        if found is None:
            lines.append(f"MISSING  {figure.doc}: no text matches {figure.text!r}")
            continue
        stated = [f"< {group}" if figure.below else group for group in found.groups()]
        try:
            printed = figure.read(outputs[figure.command])
        except (LookupError, ValueError, AttributeError, StopIteration) as error:
            lines.append(f"MISMATCH {figure.doc}: {found.group(0)!r}: the output of {figure.command!r} "
                         f"has no such figure ({type(error).__name__}: {error})")
            continue
        good = len(stated) == len(printed) and all(map(matches, stated, printed))
        verdict = "ok      " if good else "MISMATCH"
        shown = ", ".join(f"{value:.6g}" if isinstance(value, float) else str(value) for value in printed)
        lines.append(f"{verdict} {figure.doc}: {found.group(0)!r}; printed {shown}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated commands to rerun, of {', '.join(COMMANDS)} "
                                       f"(default: {','.join(DEFAULT)})")
    parser.add_argument("--keep", type=Path, help="run in this folder (created; kept) instead of a temporary one")
    args = parser.parse_args()
    chosen = [name.strip() for name in (args.only or ",".join(DEFAULT)).split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(COMMANDS))
    if unknown:
        parser.error(f"unknown command {', '.join(unknown)}; choose from {', '.join(COMMANDS)}")
    names = [name for name in COMMANDS if name in chosen or any(name in NEEDS.get(c, []) for c in chosen)]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="normswap-figures-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        outputs = run_commands(names, folder)
        lines = check([figure for figure in FIGURES if figure.command in chosen], outputs)
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    print("\n".join(lines))
    for command, reason in SKIPPED.items():
        print(f"skipped  {command}: {reason}")
    for name in sorted(set(COMMANDS) - set(names)):
        print(f"not run  {name}: pass --only {name} to rerun its figures")
    failed = [line for line in lines if not line.startswith("ok")]
    print(f"{len(lines) - len(failed)} of {len(lines)} figures match; {len(SKIPPED)} commands skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
