"""Suite-wide settings.

The test models are tiny: one torch thread runs them fastest, and avoids oversubscribing the
2-core CI machine when torch's thread pool would otherwise spin on every small op.
"""

import os

import torch

torch.set_num_threads(1)
# transformers' load-time progress bars would bury pytest's output
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
