"""Generation with a static KV cache under ``torch.compile``: ``compile_for_generation(model)``.

CUDA graphs (``mode="reduce-overhead"``) replay a whole decode step with one launch, which
removes the host time per kernel that eager decode pays; they need fixed shapes, hence the
static cache, and one graph, hence ``fullgraph=True``. Inside the graph the norms are either the
fallback's torch ops, which Inductor fuses with the residual adds and casts around them
(``"decompose"``, the default), or normswap's kernel as an opaque custom op (``"kernel"``); see
``normswap.kernels.set_compile_path``. Residual handoffs between blocks (``fusion``) are eager
only: compiled graphs add and normalise in one Inductor kernel of their own.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops.rms_norm import set_compile_path


def compile_for_generation(
    model: nn.Module, *, mode: str | None = "reduce-overhead", norm_path: str = "decompose", backend: str = "inductor"
) -> nn.Module:
    """Set ``model`` up to ``generate`` with a static cache and a compiled forward; returns it.

    ``model.generate(...)`` then runs prefill and each decode step through one compiled graph
    per shape (the first calls compile). ``norm_path`` picks how the norms appear in that graph.
    """
    set_compile_path(norm_path)
    model.generation_config.cache_implementation = "static"
    model.generation_config.disable_compile = True  # transformers' own decode-step compile: this replaces it
    options = {"mode": mode} if mode is not None else {}
    # dynamic=False: one graph per shape, as CUDA graphs want (a prompt length, the decode step)
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=backend, **options)
    return model
