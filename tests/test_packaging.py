"""A non-editable install: the wheel carries the bundled model, tasks and recipes, and the main
job runs from it, outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import sys, normswap
from pathlib import Path
assert Path(normswap.__file__).is_relative_to(Path(sys.argv[1])), normswap.__file__
from normswap.evaluation.local_tasks import local_tasks
from normswap.evaluation.recipe import load_recipe
assert sorted(local_tasks()) == ["persuasion_cloze", "persuasion_lastword", "persuasion_rolling"], local_tasks()
assert load_recipe("austen-gpt2").source == "normswap:austen-gpt2"
from normswap.cli import main
raise SystemExit(main(["convert", "normswap:austen-gpt2", "--out", "out", "--verify", "none", "--no-progress"]))
"""


def test_a_wheel_install_has_the_tasks_and_recipes_and_converts(tmp_path):
    source = tmp_path / "source"  # a copy, so the build writes nothing into the checkout
    shutil.copytree(ROOT / "normswap", source / "normswap", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "wheel").glob("normswap-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"normswap/recipes/austen-gpt2.yaml", "normswap/evals/persuasion_rolling.yaml",
            "normswap/evals/data/persuasion_rolling.jsonl"} <= names
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                              str(site), str(wheel)], capture_output=True, text=True, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-2000:]
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", CHECK, str(site)], capture_output=True, text=True, cwd=work, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (work / "out" / "model.safetensors").is_file()
