"""Geometry of the all-ones direction at every norm's input (``normswap geometry``).

* ``stats``   pure float64 statistics (cos θ to 1, mean share, RMS/std, naive-swap error, mean dims);
* ``collect`` forward pre-hooks that feed every norm's input to those statistics;
* ``report``  position dependence, dominant dimensions, text tables;
* ``plot``    the PNG; ``cli`` the command.
"""

from normswap.analysis.collect import find_norms, run_geometry
from normswap.analysis.report import build_report, format_comparison, format_report

__all__ = ["build_report", "find_norms", "format_comparison", "format_report", "run_geometry"]
