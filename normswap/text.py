"""Text normswap prints and records: tables of verification figures, and strict JSON."""

from __future__ import annotations

import json
import math
from typing import Any


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in agreement: "1 norm bias", "2 norm biases", "0 writers".

    The plural is ``plural`` when given, else ``noun`` + "es" after s, x, z, ch, sh, else + "s";
    in a compound noun ("norm bias") the last word is the one inflected."""
    if n == 1:
        return f"{n} {noun}"
    if plural is None:
        plural = noun + ("es" if noun.endswith(("s", "x", "z", "ch", "sh")) else "s")
    return f"{n} {plural}"


def json_safe(value: Any) -> Any:
    """``value`` with inf and nan as null (JSON has neither) and other non-JSON values as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def json_text(data: Any) -> str:
    """``data`` as strict JSON text (what ``json.loads`` and every other parser accept)."""
    return json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n"


def format_table(rows: dict[str, dict]) -> str:
    """A Markdown table of verification figures, one row per loader."""
    columns = ["max_abs_diff", "mean_kl", "top1_agreement", "perplexity_reference", "perplexity_candidate"]
    present = [c for c in columns if any(c in figures for figures in rows.values())]
    head = "| loader | " + " | ".join(present) + " | within tolerance |"
    lines = [head, "|" + "---|" * (len(present) + 2)]
    for loader, figures in rows.items():
        if "refused" in figures:
            verdict = "refuses to load, as it must" if figures["refused"] else "LOADED (wrong model)"
            lines.append(f"| {loader} | " + " | ".join("-" for _ in present) + f" | {verdict} |")
            continue
        cells = [_cell(figures.get(c), digits=6 if c.startswith("perplexity") else 3) for c in present]
        verdict = figures.get("passed")
        lines.append(f"| {loader} | " + " | ".join(cells) + f" | {'yes' if verdict else 'no' if verdict is not None else '-'} |")
    return "\n".join(lines)


def _cell(value, digits: int = 3) -> str:
    """A figure in a table: differences to 3 significant digits; perplexities to 6, so that two
    models that differ show it (``113.482 | 113.496``, not ``113 | 113``)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.{max(digits, 4)}g}"
    return str(value)
