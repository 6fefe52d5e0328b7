"""Signals and kills during a command: one line, and nothing left that a later run cannot clean.

Every signal that ends a process by default and stops a command (SIGHUP from a closed
terminal, SIGQUIT, SIGUSR1, as SIGTERM and SIGINT) is one interrupt; a closed output pipe is one
line. The commands run in subprocesses: a signal and a kill need a process of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_gpt2

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each case starts a fresh interpreter


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("kills") / "gpt2")


def run_script(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["SIGHUP", "SIGQUIT", "SIGUSR1"])
def test_a_signal_that_ends_a_process_is_an_interrupt(source, tmp_path, name):
    out = tmp_path / "deep" / "out"
    script = (
        "import os, signal\n"
        "from normswap.convert import install as pipeline\n"
        "real = pipeline.write_weights\n"
        "def write(*a, **k):\n"
        "    real(*a, **k)\n"
        f"    os.kill(os.getpid(), signal.{name})\n"
        "pipeline.write_weights = write\n"
        "from normswap.cli import main\n"
        f"raise SystemExit(main(['convert', {str(source)!r}, '--out', {str(out)!r}, '--quiet']))\n"
    )
    process = run_script(script)
    lines = [line for line in process.stderr.splitlines() if line.strip()]
    assert process.returncode == 130 and lines == ["normswap convert: interrupted; nothing was written"], process.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_closed_output_pipe_is_one_line():
    read, write = os.pipe()
    os.close(read)
    try:
        process = subprocess.run([sys.executable, "-m", "normswap.cli", "inspect", "normswap:austen-gpt2"],
                                 stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    lines = [line for line in process.stderr.splitlines() if line.strip()]
    assert process.returncode != 0 and len(lines) == 1 and "Broken pipe" in lines[0], process.stderr
