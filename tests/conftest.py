"""Suite-wide settings.

``python3 -m pytest -q`` runs every test; ``-m "not slow"`` leaves out the long end-to-end runs
(the ``slow`` marker, registered in pyproject.toml) for a quick loop.

The test models are tiny: one torch thread runs them fastest, and avoids oversubscribing the
2-core CI machine when torch's thread pool would otherwise spin on every small op.
"""

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Import triton.language once in interpreter mode: if transformers imports it first in
    # compiled mode, the kernels' CPU-interpreter tests fall back to a reduction ~10x slower.
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:  # triton is optional; kernel tests skip without it
        pass
    del os.environ["TRITON_INTERPRET"]
# transformers' load-time progress bars would bury pytest's output
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tests write under a temporary folder, never into the repository: benchmark results in
# benchmarks/results/ are committed figures, and a run of the suite must not add to them.
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
_RESULTS_KEY = pytest.StashKey[set]()


def _results_files() -> set[Path]:
    return {path for path in RESULTS.rglob("*") if path.is_file()} if RESULTS.is_dir() else set()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_RESULTS_KEY] = _results_files()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_RESULTS_KEY, None)
    added = sorted(_results_files() - before) if before is not None else []
    if added:
        names = ", ".join(str(path.relative_to(RESULTS.parents[1])) for path in added)
        session.config.get_terminal_writer().line(f"the test run wrote into benchmarks/results/: {names}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
