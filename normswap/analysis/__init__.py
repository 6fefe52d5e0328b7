"""Geometry of the all-ones direction at every norm's input (``normswap geometry``).

* ``stats``   pure float64 statistics (cos θ to 1, mean share, RMS/std, naive-swap error, mean dims);
* ``collect`` forward pre-hooks that feed every norm's input to those statistics;
* ``report``  position dependence, dominant dimensions, text tables;
* ``plot``    the PNG; ``cli`` the command.


Names are imported lazily so that building the command line does not import torch.
"""

from __future__ import annotations

from pathlib import Path

from normswap.lazy import lazy_getattr

# The text measured when none is given: an excerpt of Persuasion shipped with the package.
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "text" / "persuasion-excerpt.txt"

# Config keys that give a model's maximum sequence length, in the order transformers' families use them.
_EXPORTS = {
    "find_norms": "normswap.analysis.collect",
    "run_geometry": "normswap.analysis.collect",
    "build_report": "normswap.analysis.report",
    "format_comparison": "normswap.analysis.report",
    "format_report": "normswap.analysis.report",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
