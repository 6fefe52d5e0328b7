"""Suite-wide settings.

The test models are tiny: one torch thread runs them fastest, and avoids oversubscribing the
2-core CI machine when torch's thread pool would otherwise spin on every small op.
"""

import os

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


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    import pytest

    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
