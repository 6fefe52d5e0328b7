"""Optional dependencies, grouped in the package's extras.

The core install (torch, transformers, safetensors, accelerate, tqdm, pyyaml) converts, verifies
and loads. Evaluation, plots and the Triton kernels come with extras; a command that needs one
that is missing stops with one line naming the extra and the command that installs it.
"""

from __future__ import annotations

import importlib.util

from normswap.errors import NormswapError

# extra -> (importable module, distribution that provides it)
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    "eval": (("lm_eval", "lm-eval"), ("matplotlib", "matplotlib")),
    "plot": (("matplotlib", "matplotlib"),),
    "kernels": (("triton", "triton"),),
}


def missing(extra: str) -> list[str]:
    """Distributions of ``extra`` that are not installed (found without importing them)."""
    return [dist for module, dist in EXTRAS[extra] if importlib.util.find_spec(module) is None]


def install_hint(extra: str) -> str:
    return f"pip install 'normswap[{extra}]'"


def require(extra: str, what: str) -> None:
    """Raise a one-line ``NormswapError`` when ``extra`` is not installed; ``what`` needs it."""
    absent = missing(extra)
    if absent:
        raise NormswapError(
            f"{what} needs the '{extra}' extra ({', '.join(absent)} not installed): {install_hint(extra)}"
        )
