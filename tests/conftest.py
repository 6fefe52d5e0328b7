"""Suite-wide settings.

``python3 -m pytest -q`` runs every test; ``-m "not slow"`` leaves out the long end-to-end runs
(the ``slow`` marker, registered in pyproject.toml) for a quick loop.

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

