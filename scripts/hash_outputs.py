"""Hash every file that ``convert``, ``convert --fold-gains``, ``rotate`` (each method) and
``rotate --slice`` write for every family's tiny test model.

    python3 scripts/hash_outputs.py OUT.json [--families gpt2,opt]

The test models are the ones ``tests/test_every_command.py`` builds, with fixed seeds, so two
source trees that write the same bytes give the same JSON. A command that refuses a family is
recorded as its exit code and first error line, so refusals are compared too. Compare two runs
with ``python3 scripts/hash_outputs.py --compare BEFORE.json AFTER.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def commands(src: Path, out: Path, calibration: Path) -> dict[str, list[str]]:
    """Each written checkpoint's name and the command line that writes it."""
    s, text = str(src), str(calibration)
    return {
        "convert": ["convert", s, "--out", str(out / "convert"), "--quiet", "--verify", "none"],
        "convert-fold": ["convert", s, "--out", str(out / "convert-fold"), "--fold-gains", "--quiet",
                         "--verify", "none"],
        "rotate-hadamard": ["rotate", s, "--out", str(out / "rotate-hadamard"), "--method", "hadamard",
                            "--seed", "3", "--quiet", "--verify", "none"],
        "rotate-orthogonal": ["rotate", s, "--out", str(out / "rotate-orthogonal"), "--method", "orthogonal",
                              "--seed", "3", "--quiet", "--verify", "none"],
        "rotate-pca": ["rotate", s, "--out", str(out / "rotate-pca"), "--method", "pca", "--calibration", text,
                       "--calibration-tokens", "512", "--quiet", "--verify", "none"],
        "rotate-slice": ["rotate", s, "--out", str(out / "rotate-slice"), "--slice", "0.25", "--calibration", text,
                         "--calibration-tokens", "512", "--quiet"],
    }


def run_one(argv: list[str]) -> tuple[int, str]:
    from normswap.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    lines = [line for line in err.getvalue().splitlines() if "error" in line]
    return code, (lines[0] if lines else "")


def hash_family(family: str, work: Path, calibration: Path) -> dict:
    import torch
    from test_every_command import build

    torch.manual_seed(0)
    src, _ = build(family, work / family)  # the second item names eval's inputs, which no command here takes
    results = {}
    for name, argv in commands(src, work / f"{family}-out", calibration).items():
        torch.manual_seed(0)
        code, message = run_one(argv)
        out = Path(argv[argv.index("--out") + 1])
        files = {p.relative_to(out).as_posix(): sha256(p) for p in sorted(out.rglob("*")) if p.is_file()} \
            if code == 0 else {}
        results[name] = {"exit": code, "error": message, "files": files}
        print(f"{family:12s} {name:18s} exit {code} {len(files)} files {message[:90]}", file=sys.stderr)
    return results


def outcome(result: dict) -> tuple[int, str]:
    """A command's exit code and error line, less the name of the temporary traceback file."""
    return result["exit"], re.sub(r"normswap-traceback-\w+\.txt", "normswap-traceback-*.txt", result["error"])


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    compared = identical = 0
    problems = []
    for family in sorted(set(a) | set(b)):
        for command in sorted(set(a.get(family, {})) | set(b.get(family, {}))):
            x, y = a.get(family, {}).get(command), b.get(family, {}).get(command)
            if x is None or y is None or outcome(x) != outcome(y):
                problems.append(f"{family} {command}: outcome differs: {x and x['exit']} vs {y and y['exit']}")
                continue
            for name in sorted(set(x["files"]) | set(y["files"])):
                compared += 1
                if x["files"].get(name) == y["files"].get(name):
                    identical += 1
                else:
                    problems.append(f"{family} {command} {name}: differs")
    for line in problems:
        print(line)
    print(f"{compared} files compared, {identical} identical; {len(problems)} differences")
    return 0 if not problems else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="write the hashes here (JSON)")
    parser.add_argument("--families", help="comma-separated families (default: all)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "normswap-hash-outputs",
                        help="scratch folder, removed and recreated (default: TMPDIR/normswap-hash-outputs)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    from test_every_command import FAMILIES

    import normswap

    calibration = Path(normswap.__file__).parent / "data" / "text" / "emma-excerpt.txt"
    families = args.families.split(",") if args.families else FAMILIES
    # the source's path is recorded in what is written, so every run uses the same folder
    work = args.work
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    hashes = {family: hash_family(family, work, calibration) for family in families}
    shutil.rmtree(work)
    args.out.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
