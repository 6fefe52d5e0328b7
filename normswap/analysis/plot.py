"""PNG of the per-norm geometry: mean share along 1, RMS/std and naive-swap error, per model."""

from __future__ import annotations

from pathlib import Path

from normswap.extras import require

# Log axes cannot show an exact 0 (a perfectly centred input); draw it at this floor instead.
_FLOOR = 1e-17


_SHORT = {"attention": "attn", "embedding": "emb"}


def _label(n: dict) -> str:
    prefix = n["stack"][:3] + " " if n["stack"] else ""
    kind = _SHORT.get(n["kind"], n["kind"])
    return prefix + kind if n["layer"] is None else f"{prefix}{n['layer']} {kind}"


def _clip(values: list[float]) -> list[float]:
    return [max(v, _FLOOR) for v in values]


def plot_reports(reports: dict[str, dict], path: str | Path) -> Path:
    """Write a three-panel PNG comparing ``reports`` (label → report) norm by norm, in data-flow order.

    1. mean |cos θ| (= mean share |μ|√d/‖x‖) with its p5–p95 band over tokens, and the pooled share
       dashed; log scale, so that a converted model's floating-point-noise floor is visible;
    2. RMS(x)/std(x), mean with p5–p95 band;
    3. naive-swap output error ‖LN(x) − RMSNorm(x)‖/‖LN(x)‖, mean with p5–p95 band; log scale.
    """

    require("plot", "a geometry plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(reports.values()))
    labels = [_label(n) for n in first["norms"]]
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 0.32 * len(labels) + 3), 10), sharex=True)
    panels = [
        ("mean |cos θ| = mean share along 1", "abs_cos", True),
        ("RMS(x) / std(x)", "rms_over_std", False),
        ("naive-swap error ‖LN−RMSNorm‖/‖LN‖", "naive_error", True),
    ]
    from normswap.analysis.report import display_label

    for (title, key, log), ax in zip(panels, axes, strict=True):
        for i, (label, report) in enumerate(reports.items()):
            name = display_label(label, report)
            norms = report["norms"]
            xs = list(range(len(norms)))
            colour = f"C{i}"
            mean = [n[key]["mean"] for n in norms]
            low = [n[key]["p5"] for n in norms]
            high = [n[key]["p95"] for n in norms]
            if log:
                mean, low, high = _clip(mean), _clip(low), _clip(high)
            ax.plot(xs, mean, marker="o", ms=3, color=colour, label=f"{name} (mean)")
            ax.fill_between(xs, low, high, color=colour, alpha=0.2, label=f"{name} (p5–p95)")
            if key == "abs_cos":
                pooled = [n["pooled_share"] for n in norms]
                ax.plot(xs, _clip(pooled), ls="--", color=colour, label=f"{name} (pooled share)")
        if key == "abs_cos":
            ax.axhline(first["norms"][0]["isotropic_mean_share"], color="grey", ls=":",
                       label="random isotropic vector")
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xticks(range(len(labels)))
    axes[-1].set_xticklabels(labels, rotation=90, fontsize=7)
    axes[-1].set_xlabel("norm (data-flow order)")
    fig.suptitle(f"{first['model']}: {first['tokens']} tokens", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
