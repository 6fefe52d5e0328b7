"""Verify: run the original and the converted model on the same probe and compare outputs.

Both are loaded in float32 whatever the checkpoint dtype, so the figures measure the conversion
(the centred and folded weights, rounded to the checkpoint dtype), not runtime rounding.

For language models the figures are max |Δlogit|, the mean KL(original ‖ converted) of the
next-token distributions, top-1 agreement, and the probe perplexity of both. For encoders the
compared output is the family's pooled or last hidden state and only max |Δ| applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from normswap.errors import NormswapError

# (atol, rtol) on max |Δoutput| by checkpoint dtype: tolerance = atol + rtol * max |output|.
# fp32: rounding of centred weights is ~1e-7 relative, amplified by depth; 1e-4 absolute is tight
# for GPT-2-small-sized logits. bf16 keeps 8 mantissa bits, so re-rounding the centred weights
# moves each by up to 2^-9 relative and logits by a few 1e-2.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-4, 1e-5),  # verification computes in float32 whatever the weights
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-2, 2e-3),
    torch.bfloat16: (1e-1, 1e-2),
}

PROBE_TOKENS = 64
PROBE_BATCH = 2


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])


def probe_text() -> str:
    """A paragraph of real English text (public domain) for probing through the tokenizer."""
    excerpt = resources.files("normswap") / "data" / "text" / "persuasion-excerpt.txt"
    if excerpt.is_file():
        return excerpt.read_text(encoding="utf-8")[:20000]
    return (
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be "
        "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
        "surrounding families, that he is considered the rightful property of some one or other of "
        "their daughters."
    )


@dataclass
class Probe:
    """Model inputs and how they were made."""

    inputs: dict[str, torch.Tensor]
    kind: str  # "text" or "random"


def causal_lm_probe(config, tokenizer, seed: int = 0) -> Probe:
    """Token ids [PROBE_BATCH, n]: real text through the tokenizer when there is one, else random ids."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
    length = min(PROBE_TOKENS, int(limit))
    if tokenizer is not None:
        ids = tokenizer(probe_text(), return_tensors="pt")["input_ids"][0]
        if ids.numel() >= PROBE_BATCH * length:
            ids = ids[: PROBE_BATCH * length].reshape(PROBE_BATCH, length)
            return Probe({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "text")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (PROBE_BATCH, length), generator=generator)
    return Probe({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "random")


PROBES = {"causal_lm": causal_lm_probe}


@torch.no_grad()
def model_output(model, probe: Probe, kind: str) -> torch.Tensor:
    """The compared output of ``model`` on ``probe``, as float64."""
    outputs = model(**probe.inputs)
    if kind == "causal_lm":
        return outputs.logits.double()
    raise NormswapError(f"unknown probe kind {kind}")


def compare_outputs(reference: torch.Tensor, candidate: torch.Tensor, *, distribution: bool, labels=None) -> dict:
    """Figures comparing ``candidate`` with ``reference`` (float64 tensors of equal shape)."""
    figures = {"max_abs_diff": float((reference - candidate).abs().max()), "max_abs_reference": float(reference.abs().max())}
    if distribution:
        log_p = torch.log_softmax(reference, dim=-1)
        log_q = torch.log_softmax(candidate, dim=-1)
        figures["mean_kl"] = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
        figures["top1_agreement"] = float((reference.argmax(-1) == candidate.argmax(-1)).double().mean())
        if labels is not None:
            figures["perplexity_reference"] = _perplexity(log_p, labels)
            figures["perplexity_candidate"] = _perplexity(log_q, labels)
    return figures


def _perplexity(log_probs: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean next-token negative log-likelihood."""
    picked = log_probs[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return float(math.exp(-picked.mean()))


def within_tolerance(figures: dict, atol: float, rtol: float) -> bool:
    return figures["max_abs_diff"] <= atol + rtol * figures["max_abs_reference"]


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when it has none or it cannot be built offline."""
    if not any((path / name).is_file() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception:  # a broken tokenizer must not stop verification: random ids still work
        return None


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
        cells = [_cell(figures.get(c)) for c in present]
        verdict = figures.get("passed")
        lines.append(f"| {loader} | " + " | ".join(cells) + f" | {'yes' if verdict else 'no' if verdict is not None else '-'} |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.4g}"
    return str(value)
