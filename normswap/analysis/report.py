"""Turn per-norm summaries into a report: position dependence, dominant dimensions, tables.

A *report* is a plain JSON-able dict::

    {"model": str, "dtype": str, "tokens": int, "text": str, "norms": [per-norm summary, ...],
     "position": {...}, "dominant_dims": [...], "overall": {...}}

where each per-norm summary is the dict built by ``collect.NormRecord.summary``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from normswap.analysis import stats
from normswap.text import count

# The per-norm figures whose dependence on depth is reported: (label, getter).
_METRICS = {
    "mean_share": lambda n: n["mean_share"],
    "mean_cos": lambda n: n["cos"]["mean"],
    "rms_over_std": lambda n: n["rms_over_std"]["mean"],
    "naive_error": lambda n: n["naive_error"]["mean"],
}


def noise_level(dtype: torch.dtype) -> float:
    """Largest mean share that still counts as floating-point noise for a model run in ``dtype``.

    8 ulps of the compute dtype, but never below 1e-6: a converted fp32 checkpoint run in float64 is
    still only as centred as its fp32 weights are.
    """
    return max(8 * torch.finfo(dtype).eps, 1e-6)


def position_dependence(norms: list[dict]) -> dict:
    """How the statistics vary with the norm's position.

    ``depth``: per stack, Spearman and Pearson correlation with the layer index, and the least-squares
    slope per layer, over all in-layer norms and separately per kind (attention / mlp / cross).
    ``by_kind``: per stack and kind, the average of each metric over the norms of that kind.
    """
    depth: dict[str, dict] = {}
    by_kind: dict[str, dict] = {}
    stacks = sorted({n["stack"] for n in norms})
    for stack in stacks:
        label = stack or "all"
        in_stack = [n for n in norms if n["stack"] == stack]
        groups = {"all_layers": [n for n in in_stack if n["layer"] is not None]}
        for kind in ("attention", "mlp", "cross"):
            groups[kind] = [n for n in groups["all_layers"] if n["kind"] == kind]
        depth[label] = {}
        for group, members in groups.items():
            if len(members) < 3:
                continue
            layers = [float(n["layer"]) for n in members]
            depth[label][group] = {
                metric: {
                    "spearman": stats.spearman(layers, [get(n) for n in members]),
                    "pearson": stats.pearson(layers, [get(n) for n in members]),
                    "slope_per_layer": stats.slope(layers, [get(n) for n in members]),
                }
                for metric, get in _METRICS.items()
            }
        kinds: dict[str, list[dict]] = defaultdict(list)
        for n in in_stack:
            kinds[n["kind"]].append(n)
        by_kind[label] = {
            kind: {"norms": len(members),
                   **{metric: sum(get(n) for n in members) / len(members) for metric, get in _METRICS.items()}}
            for kind, members in kinds.items()
        }
    return {"depth": depth, "by_kind": by_kind}


def dominant_dims(norms: list[dict], min_share: float = 0.1) -> list[dict]:
    """Hidden dimensions that carry the mean at several norms.

    For every dimension listed among a norm's top contributors with |share_of_mean| ≥ ``min_share``:
    at how many norms it does so, and its median share there. Sorted by that count.
    """
    seen: dict[int, list[float]] = defaultdict(list)
    for n in norms:
        for entry in n["mean_dims"]:
            if abs(entry["share_of_mean"]) >= min_share:
                seen[entry["dim"]].append(entry["share_of_mean"])
    rows = [{"dim": dim, "norms": len(shares), "median_share_of_mean": sorted(shares)[len(shares) // 2]}
            for dim, shares in seen.items()]
    return sorted(rows, key=lambda r: (-r["norms"], -abs(r["median_share_of_mean"])))


def overall(norms: list[dict], dtype: torch.dtype) -> dict:
    """Whole-model headline figures, and whether the mean component is at floating-point noise."""
    worst_share = max(norms, key=lambda n: n["mean_share"])
    worst_error = max(norms, key=lambda n: n["naive_error"]["mean"])
    noise = noise_level(dtype)
    max_token_share = max(n["abs_cos"]["max"] for n in norms)
    by_stack = {}
    for stack in dict.fromkeys(n["stack"] for n in norms):
        members = [n for n in norms if n["stack"] == stack]
        by_stack[stack or "all"] = {
            "norms": len(members),
            "tokens": max(n["tokens"] for n in members),
            "mean_share_avg": sum(n["mean_share"] for n in members) / len(members),
            "mean_share_min": min(n["mean_share"] for n in members),
            "mean_share_max": max(n["mean_share"] for n in members),
            "naive_error_avg": sum(n["naive_error"]["mean"] for n in members) / len(members),
        }
    return {
        "norms": len(norms),
        "by_stack": by_stack,
        "mean_share_avg": sum(n["mean_share"] for n in norms) / len(norms),
        # what a random direction would give, for scale (one value per hidden size present)
        "isotropic_mean_share": {str(n["d"]): n["isotropic_mean_share"] for n in norms},
        "mean_share_max": worst_share["mean_share"],
        "mean_share_max_at": worst_share["name"],
        "token_share_max": max_token_share,
        "naive_error_avg": sum(n["naive_error"]["mean"] for n in norms) / len(norms),
        "naive_error_max": worst_error["naive_error"]["mean"],
        "naive_error_max_at": worst_error["name"],
        "noise_level": noise,
        "mean_at_noise": max_token_share <= noise,
    }


def build_report(norms: list[dict], *, model: str, dtype: torch.dtype, tokens: int, text: str) -> dict:
    """Assemble the report dict (see the module docstring) from per-norm summaries."""
    noise = noise_level(dtype)
    for n in norms:
        if n["abs_cos"]["max"] <= noise:
            # Attributing a mean that is rounding noise to dimensions gives meaningless huge shares.
            n["mean_dims"] = []
    return {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens,
        "text": text,
        "norms": norms,
        "position": position_dependence(norms),
        "dominant_dims": dominant_dims(norms),
        "overall": overall(norms, dtype),
    }


# --- text output -------------------------------------------------------------------------------


def _g(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3g}"


def _ratio(value: float) -> str:
    # RMS/std = 1/|sin θ| ≈ 1 + cos²θ/2 sits just above 1 on real models: show the digits that matter.
    return "-" if value is None or math.isnan(value) else f"{value:.6f}"


def _where(n: dict) -> str:
    layer = "" if n["layer"] is None else str(n["layer"])
    return f"{n['stack'][:3] + ' ' if n['stack'] else ''}{layer:>3} {n['kind']}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def fmt(cells: list[str]) -> str:
        # Names and positions left-aligned, numbers right-aligned.
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def format_report(report: dict, top: int = 2) -> str:
    """The human-readable table and summary printed by ``normswap geometry``."""
    header = ["norm", "position", "mean cos", "mean|cos|", "p5 cos", "p50 cos", "p95 cos", "pooled", "|cos|@0",
              "RMS/std", "naive err", "err p95", "top mean dims (dim:share)"]
    rows = []
    for n in report["norms"]:
        dims = " ".join(f"{e['dim']}:{e['share_of_mean']:+.2f}" for e in n["mean_dims"][:top])
        rows.append([n["name"], _where(n), _g(n["cos"]["mean"]), _g(n["mean_share"]), _g(n["cos"]["p5"]),
                     _g(n["cos"]["p50"]), _g(n["cos"]["p95"]), _g(n["pooled_share"]),
                     _g(n["mean_share_first_position"]),
                     _ratio(n["rms_over_std"]["mean"]), _g(n["naive_error"]["mean"]), _g(n["naive_error"]["p95"]),
                     dims])
    lines = [f"{report['model']}: {report['tokens']} tokens of {report['text']}, {report['dtype']}",
             "cos = cos(x, 1) at the norm's input; mean|cos| is the mean share |mu|*sqrt(d)/||x||; pooled weights "
             "tokens by ||x||^2; |cos|@0 is the mean share at the first position of each window; naive err = ||LN(x) - RMSNorm(x)|| / ||LN(x)|| with the norm's own gamma/beta",
             "", _table(header, rows), "", *format_summary(report)]
    return "\n".join(lines)


def format_summary(report: dict) -> list[str]:
    """Headline, depth trends, role averages and dominant dimensions, as lines of text."""
    o = report["overall"]
    lines = [f"mean share: average {_g(o['mean_share_avg'])}, largest {_g(o['mean_share_max'])} at "
             f"{o['mean_share_max_at']}; largest single token {_g(o['token_share_max'])}",
             "  for scale, a random isotropic vector has mean |cos| "
             + ", ".join(f"{_g(v)} (d={d})" for d, v in o["isotropic_mean_share"].items())]
    if len(o.get("by_stack", {})) > 1:
        for stack, v in o["by_stack"].items():
            lines.append(f"side {stack}: {count(v['norms'], 'norm')} over {count(v['tokens'], 'position')}, mean share average "
                         f"{_g(v['mean_share_avg'])} (range {_g(v['mean_share_min'])}-{_g(v['mean_share_max'])}), "
                         f"naive err average {_g(v['naive_error_avg'])}")
    if o["mean_at_noise"]:
        lines.append(f"every norm input is orthogonal to 1 to floating-point noise (<= {_g(o['noise_level'])})")
    lines.append(f"naive-swap output error: average {_g(o['naive_error_avg'])}, largest {_g(o['naive_error_max'])} "
                 f"at {o['naive_error_max_at']}")
    for stack, groups in report["position"]["depth"].items():
        for group, metrics in groups.items():
            share, error = metrics["mean_share"], metrics["naive_error"]
            lines.append(f"depth trend ({stack}, {group}): mean share spearman {_g(share['spearman'])}, "
                         f"slope {_g(share['slope_per_layer'])}/layer; naive err spearman {_g(error['spearman'])}")
    for stack, kinds in report["position"]["by_kind"].items():
        parts = [f"{kind} ({v['norms']}): share {_g(v['mean_share'])}, err {_g(v['naive_error'])}"
                 for kind, v in kinds.items()]
        lines.append(f"by role ({stack}): " + "; ".join(parts))
    if report["dominant_dims"]:
        dims = ", ".join(f"{r['dim']} ({count(r['norms'], 'norm')}, median {r['median_share_of_mean']:+.2f})"
                         for r in report["dominant_dims"][:5])
        lines.append(f"dimensions carrying the mean (share >= 0.1 at a norm): {dims}")
    return lines


def display_label(label: str, report: dict) -> str:
    """What a measured model is called in tables and plots: a rotated checkpoint is "rotated"."""
    return "rotated" if label == "converted" and report.get("rotated") else label


def format_comparison(original: dict, converted: dict) -> str:
    """Original and converted statistics side by side, matched by norm name (else by order)."""
    by_name = {n["name"]: n for n in converted["norms"]}
    if all(n["name"] in by_name for n in original["norms"]):
        pairs = [(n, by_name[n["name"]]) for n in original["norms"]]
    else:
        pairs = list(zip(original["norms"], converted["norms"], strict=False))
    header = ["norm", "position", "mean|cos| orig", "conv", "pooled orig", "conv", "RMS/std orig", "conv",
              "naive err orig", "conv"]
    rows = [[a["name"], _where(a), _g(a["mean_share"]), _g(b["mean_share"]), _g(a["pooled_share"]),
             _g(b["pooled_share"]), _ratio(a["rms_over_std"]["mean"]), _ratio(b["rms_over_std"]["mean"]),
             _g(a["naive_error"]["mean"]), _g(b["naive_error"]["mean"])] for a, b in pairs]
    name = display_label("converted", converted)
    lines = [f"original:  {original['model']}", f"{name}:{' ' * max(1, 10 - len(name))}{converted['model']}",
             f"{original['tokens']} tokens of {original['text']}, {original['dtype']}", "",
             _table(header, rows), "", "original:", *format_summary(original), "", f"{name}:",
             *format_summary(converted)]
    if converted.get("rotated"):
        lines.append("note: the compared checkpoint is rotated: its stream is h·Q (C·h·Q in the free form), "
                     "not orthogonal to 1 by design (its norms commute with the rotation)")
    elif not converted["overall"]["mean_at_noise"]:
        lines.append(f"warning: the converted model's norm inputs are NOT orthogonal to 1 "
                     f"(largest token share {_g(converted['overall']['token_share_max'])})")
    return "\n".join(lines)


def to_markdown(reports: dict[str, dict], text: str) -> str:
    """report.md: which models were measured on what, and the tables as printed."""
    lines = ["# normswap geometry", ""]
    lines += [f"- **{label}**: `{report.get('model')}`" for label, report in reports.items()]
    first = next(iter(reports.values()))
    lines += [f"- **measured on**: {first.get('text')} ({first.get('tokens')} tokens)", "", "```", text, "```", ""]
    return "\n".join(lines)
