"""The figures README.md and docs/ print reproduce with the commands beside them.

``scripts/check_readme_figures.py`` reruns the commands and compares; the quick tests here check
that every command of the README's table of figures is either rerun by it or listed with the
reason it is not, that every figure it knows is still in its document, and how it compares.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_readme_figures as figures  # noqa: E402


def measured_commands() -> list[str]:
    """The commands in the second column of the README's "Measured" table."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Measured", 1)[1].split("\n\n", 2)[1]
    commands = []
    for row in table.splitlines()[2:]:
        beside = row.rstrip().rstrip("|").rsplit(" | ", 1)[-1]
        commands += [command for command in re.findall(r"`([^`]+)`", beside)]
    return commands


def test_every_measured_command_is_rerun_or_skipped_with_a_reason():
    commands = measured_commands()
    assert len(commands) >= 9
    for command in commands:
        assert command in figures.PRINTED or command in figures.SKIPPED, command
    assert all(key in figures.COMMANDS for key in figures.PRINTED.values())
    assert all(reason for reason in figures.SKIPPED.values())


def test_every_checked_figure_is_in_its_document():
    for figure in figures.FIGURES:
        assert re.search(figure.text, (ROOT / figure.doc).read_text(encoding="utf-8")), figure.text
    checked = {figure.command for figure in figures.FIGURES}
    assert checked == set(figures.COMMANDS)


@pytest.mark.parametrize(("stated", "printed", "agrees"), [
    ("78.0783", 78.07831, True), ("78.0783", 78.0784, False),
    ("−2.717e-04", -2.7171e-4, True), ("−2.717e-04", -2.716e-4, False),
    ("1.67", 1.66983, True), ("1.6", 1.66983, False),
    ("< 1e-8", -3.8e-9, True), ("< 1e-8", 1.2e-8, False),
    ("60", 60.0, True), ("persuasion_rolling", "persuasion_rolling", True), ("persuasion_rolling", "strided", False),
])
def test_a_figure_agrees_within_the_precision_it_is_stated_with(stated, printed, agrees):
    assert figures.matches(stated, printed) is agrees


@pytest.mark.slow
def test_readme_figures_reproduce():
    """Reruns the recipe, geometry and the naive swap (a few minutes on two cores)."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_readme_figures.py")],
                            capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "MISMATCH" not in result.stdout and "MISSING" not in result.stdout
    assert re.search(r"(\d+) of \1 figures match", result.stdout), result.stdout
