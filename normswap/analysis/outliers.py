"""Activation outliers at the inputs of linear layers: what a rotation of the residual basis changes.

For every linear layer (nn.Linear and transformers' Conv1D) the input x (all tokens × the layer's
input features) is summarised by

* the outlier ratio max|x| / RMS(x), RMS over every entry: large when a few coordinates carry
  values far above the rest (the "massive activations" that make low-bit quantisation fail);
* the kurtosis E[(x - μ)⁴] / σ⁴ of all entries: 3 for a Gaussian, large for heavy tails.

The statistics are accumulated in float64 over windows of text, so memory stays one window's
activations. Layers that read a norm (attention's q/k/v, the MLP's first layer, the head) see
the residual stream and change under a rotation; the others read inside a block and do not. The
family's adapter (``normswap.architectures``) names the readers, and every table reports them
apart from the rest, so that averaging over all layers does not hide what a rotation does.
"""

from __future__ import annotations

import copy
import math
import re

import torch
from torch import nn

from normswap.analysis.collect import _forward, windows
from normswap.architectures import ARCHITECTURES
from normswap.architectures.spec import pattern
from normswap.modeling.online import is_down_projection
from normswap.rotate.quantise import QUANTISERS, apply_quantiser, linear_layers
from normswap.runtime.offload import find_blocks


class _Moments:
    def __init__(self) -> None:
        self.count = 0
        self.sums = [0.0, 0.0, 0.0, 0.0]  # Σx, Σx², Σx³, Σx⁴
        self.max_abs = 0.0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().reshape(-1)
        self.count += x.numel()
        power = torch.ones_like(x)
        for k in range(4):
            power = power * x
            self.sums[k] += float(power.sum())
        self.max_abs = max(self.max_abs, float(x.abs().max()))

    def summary(self) -> dict:
        n = self.count
        mean, m2, m3, m4 = (value / n for value in self.sums)
        variance = m2 - mean**2
        central4 = m4 - 4 * mean * m3 + 6 * mean**2 * m2 - 3 * mean**4
        return {
            "outlier_ratio": self.max_abs / math.sqrt(m2) if m2 > 0 else float("nan"),
            "kurtosis": central4 / variance**2 if variance > 0 else float("nan"),
            "max_abs": self.max_abs,
            "rms": math.sqrt(m2),
            "entries": n,
        }


@torch.no_grad()
def linear_input_outliers(model: nn.Module, token_ids: torch.Tensor, *, seq_len: int, batch_size: int = 4) -> list[dict]:
    """Outlier statistics of every linear layer's input over ``token_ids`` (1-D), in module order."""

    layers = linear_layers(model)
    moments = {name: _Moments() for name, _, _ in layers}

    def hook(name: str):
        def record(module, args):
            moments[name].update(args[0])

        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module, _ in layers]
    device = next(model.parameters()).device
    try:
        for batch in windows(token_ids.reshape(-1).long(), seq_len, batch_size):
            _forward(model, batch.to(device))
    finally:
        for handle in handles:
            handle.remove()
    return [{"layer": name, **moments[name].summary()} for name, _, _ in layers if moments[name].count]


def stream_readers(model: nn.Module) -> list[re.Pattern] | None:
    """Patterns of the module names of the layers that read a norm's output (the residual
    stream), from the family's adapter; None for a family normswap has no adapter for."""
    from normswap.modeling.remote import MODEL_TYPE_PREFIX

    config = model.config.to_dict()
    model_type = str(config.get("model_type", "")).removeprefix(MODEL_TYPE_PREFIX)
    if model_type not in ARCHITECTURES:
        return None
    architecture = ARCHITECTURES[model_type].for_config({**config, "model_type": model_type})
    return [re.compile(pattern(reader.module)) for norm in architecture.norms for reader in norm.readers]


def mark_stream_readers(model: nn.Module, rows: list[dict]) -> None:
    """Set each row's ``reads_stream``: whether its layer reads a norm's output."""
    readers = stream_readers(model)
    for row in rows:
        row["reads_stream"] = None if readers is None else any(p.fullmatch(row["layer"]) for p in readers)


def summarise(rows: list[dict]) -> dict:
    """Mean and max of the outlier ratio and kurtosis over layers."""
    if not rows:
        return {"layers": 0}
    ratios = [row["outlier_ratio"] for row in rows]
    kurtoses = [row["kurtosis"] for row in rows]
    return {
        "layers": len(rows),
        "outlier_ratio_mean": sum(ratios) / len(ratios),
        "outlier_ratio_max": max(ratios),
        "kurtosis_mean": sum(kurtoses) / len(kurtoses),
        "kurtosis_max": max(kurtoses),
    }


def summarise_groups(rows: list[dict]) -> dict:
    """The summary over every layer (``all``), over the stream readers and over the rest."""
    groups = {"all": summarise(rows)}
    if rows and all(row.get("reads_stream") is not None for row in rows):
        groups["stream_readers"] = summarise([row for row in rows if row["reads_stream"]])
        groups["inside_blocks"] = summarise([row for row in rows if not row["reads_stream"]])
    return groups


def plot_outliers(reports: dict[str, list[dict]], path) -> None:
    """Two panels (outlier ratio, kurtosis; log scale) of each model's linear layers, side by side;
    the layers that read the stream are marked with filled dots, the others with open ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(reports.values()))
    labels = [row["layer"].split(".", 1)[-1] for row in first]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.3 * len(labels) + 3), 8), sharex=True)
    for index, (label, rows) in enumerate(reports.items()):
        for axis, key in zip(axes, ("outlier_ratio", "kurtosis"), strict=True):
            xs = range(len(rows))
            axis.plot(xs, [row[key] for row in rows], color=f"C{index}", alpha=0.5, label=label)
            readers = [x for x, row in zip(xs, rows, strict=True) if row.get("reads_stream")]
            others = [x for x, row in zip(xs, rows, strict=True) if not row.get("reads_stream")]
            axis.plot(readers, [rows[x][key] for x in readers], "o", color=f"C{index}",
                      label=f"{label}: reads the stream")
            axis.plot(others, [rows[x][key] for x in others], "o", mfc="none", color=f"C{index}",
                      label=f"{label}: inside a block")
    axes[0].set_ylabel("max|x| / RMS(x)")
    axes[1].set_ylabel("kurtosis")
    for axis in axes:
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].set_xticks(range(len(labels)))
    axes[1].set_xticklabels(labels, rotation=90, fontsize=7)
    axes[0].set_title("inputs of the linear layers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


GROUP_NAMES = {"stream_readers": "read the stream", "inside_blocks": "inside blocks",
               "down_projections": "MLP down projections", "all": "all"}


def format_outliers(summaries: dict[str, dict], kl: dict[str, dict[str, float]] | None = None) -> str:
    """Markdown tables: per model, the outlier ratio and kurtosis at the inputs of the layers that
    read the residual stream, of the layers inside blocks, of the MLP down projections apart, and of
    all linear layers; then, per model, the KL each quantiser costs (``kl``)."""
    lines = ["| model | linear layers | count | outlier ratio mean / max | kurtosis mean / max |",
             "|---|---|---|---|---|"]
    for label, groups in summaries.items():
        for group in ("stream_readers", "inside_blocks", "down_projections", "all"):
            summary = groups.get(group)
            if not summary or not summary["layers"]:
                continue
            lines.append(f"| {label} | {GROUP_NAMES[group]} | {summary['layers']} | "
                         f"{summary['outlier_ratio_mean']:.3g} / {summary['outlier_ratio_max']:.3g} | "
                         f"{summary['kurtosis_mean']:.3g} / {summary['kurtosis_max']:.3g} |")
    if kl and any(kl.values()):
        lines += ["", "| model | " + " | ".join(f"KL {label}" for label in QUANTISERS) + " |",
                  "|---|" + "---|" * len(QUANTISERS)]
        for label, errors in kl.items():
            lines.append(f"| {label} | " + " | ".join(f"{errors[q]:.3g}" if q in errors else "-" for q in QUANTISERS)
                         + " |")
    return "\n".join(lines)


def geometry_outliers(models: dict[str, nn.Module], token_ids: torch.Tensor, seq_len: int, batch_size: int) -> dict:
    """``normswap geometry --outliers``: per model label, the per-layer rows, their summary, the
    summary of the MLP down projections' inputs apart, and the quantisation error per quantiser."""
    results = {}
    for label, model in models.items():
        rows = linear_input_outliers(model, token_ids, seq_len=seq_len, batch_size=batch_size)
        mark_stream_readers(model, rows)
        summary = summarise_groups(rows)
        summary["down_projections"] = summarise([row for row in rows if is_down_projection(row["layer"])])
        results[label] = {"summary": summary, "layers": rows,
                          "quantisation_kl": quantisation_errors(model, token_ids, seq_len, batch_size)}
    return results


@torch.no_grad()
def quantisation_errors(model: nn.Module, token_ids: torch.Tensor, seq_len: int, batch_size: int) -> dict[str, float]:
    """Per quantiser (``normswap.rotate.quantise.QUANTISERS``), the mean KL(model ‖ quantised copy) of
    the next-token distributions over ``token_ids``, every linear layer of the residual blocks
    quantised (embeddings and head not); empty for a model without logits or blocks."""


    found = find_blocks(model, None)
    batches = list(windows(token_ids.reshape(-1).long(), seq_len, batch_size))
    device = next(model.parameters()).device

    def log_probs(candidate: nn.Module) -> list[torch.Tensor] | None:
        outputs = [getattr(candidate(input_ids=batch.to(device)), "logits", None) for batch in batches]
        return None if any(out is None for out in outputs) else [torch.log_softmax(out.double(), -1) for out in outputs]

    reference = log_probs(model) if found is not None and not model.config.is_encoder_decoder else None
    if reference is None:
        return {}
    errors = {}
    for label in QUANTISERS:
        quantised = copy.deepcopy(model)
        apply_quantiser(quantised, label, within=found[0])
        candidate = log_probs(quantised)
        errors[label] = float(sum((p.exp() * (p - q)).sum(-1).sum() for p, q in zip(reference, candidate, strict=True))
                              / sum(p.shape[0] * p.shape[1] for p in reference))
        del quantised
    return errors
