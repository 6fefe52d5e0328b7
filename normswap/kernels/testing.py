"""Running the Triton kernels in Triton's CPU interpreter, for tests on machines without CUDA.

``triton.jit`` picks compiled or interpreted code when it decorates a function. normswap's kernel
module is imported lazily, on first use, and calls no function of triton's standard library
(decorated when triton itself is first imported), so interpreting the kernels only needs
``TRITON_INTERPRET=1`` set when they first run. It must not stay set for a whole test session,
where ``normswap.kernels.use_kernels`` would send every CPU tensor to the (slow) interpreter:
wrap the code that runs the kernels in ``interpreter_env()``.

If triton itself was first imported in interpreter mode the kernels use its fast numpy
``tl.sum``; otherwise (transformers imported it first) a generic ``tl.reduce``, ~10x slower to
interpret. A suite can get the fast path by importing triton once in interpreter mode from
``tests/conftest.py`` before anything else imports it, when CUDA is absent::

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        import triton.language  # noqa: F401
        del os.environ["TRITON_INTERPRET"]
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator


@contextlib.contextmanager
def interpreter_env() -> Iterator[None]:
    """Set ``TRITON_INTERPRET=1`` for the duration of the block, restoring it afterwards; the
    eager plans cached per norm module are dropped on the way in and out (a CPU call's plan
    records whether it runs the kernels)."""
    launch = importlib.import_module("normswap.kernels.ops.launch")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    launch.generation += 1
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
        launch.generation += 1


def interpreter_unavailable() -> str | None:
    """Why the kernels cannot be interpreted here, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    launch = importlib.import_module("normswap.kernels.ops.launch")
    if launch.kernels.cache_info().currsize and not _interpreted(launch.kernels()):
        return "the kernels were already compiled for a GPU in this process"
    return None


def _interpreted(module) -> bool:
    return type(module.rms_norm_fwd_kernel).__name__ == "InterpretedFunction"
