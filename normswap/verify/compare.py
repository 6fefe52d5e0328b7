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


def seq2seq_speech_probe(config, tokenizer, seed: int = 0) -> Probe:
    """Whisper: random log-mel features and decoder ids (text through the tokenizer, else random).

    The encoder insists on exactly 2·max_source_positions frames (its second conv has stride 2);
    features are N(0, 1), the scale of Whisper's normalised log-mel input.
    """
    generator = torch.Generator().manual_seed(seed)
    frames = 2 * int(config.max_source_positions)
    features = torch.randn(PROBE_BATCH, int(config.num_mel_bins), frames, generator=generator)
    length = min(PROBE_TOKENS, int(config.max_target_positions))
    kind = "random"
    ids = None
    if tokenizer is not None:
        text_ids = tokenizer(probe_text(), return_tensors="pt")["input_ids"][0]
        if text_ids.numel() >= PROBE_BATCH * length:
            ids, kind = text_ids[: PROBE_BATCH * length].reshape(PROBE_BATCH, length), "text"
    if ids is None:
        ids = torch.randint(0, config.vocab_size, (PROBE_BATCH, length), generator=generator)
    return Probe({"input_features": features, "decoder_input_ids": ids}, kind)


def _pixels(vision_config, generator: torch.Generator) -> torch.Tensor:
    size = vision_config.image_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels = int(getattr(vision_config, "num_channels", 3))
    return torch.randn(PROBE_BATCH, channels, int(height), int(width), generator=generator)


def vision_probe(config, tokenizer, seed: int = 0) -> Probe:
    """Random N(0, 1) pixel values [PROBE_BATCH, channels, size, size] (normalised-image scale)."""
    return Probe({"pixel_values": _pixels(config, torch.Generator().manual_seed(seed))}, "random")


def clip_probe(config, tokenizer, seed: int = 0) -> Probe:
    """Token ids ending in the end-of-text token (the CLIP text tower pools there) and/or pixels.

    ``clip`` configs get both, ``clip_text_model`` ids only, ``clip_vision_model`` pixels only.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    model_type = getattr(config, "model_type", "clip")
    if model_type != "clip_vision_model":
        text = getattr(config, "text_config", None) or config
        length = min(PROBE_TOKENS, int(text.max_position_embeddings))
        ids = torch.randint(0, text.vocab_size, (PROBE_BATCH, length), generator=generator)
        eos = getattr(text, "eos_token_id", None)
        if isinstance(eos, int) and 0 <= eos < text.vocab_size:
            ids[:, -1] = eos
        inputs["input_ids"] = ids
    if model_type != "clip_text_model":
        inputs["pixel_values"] = _pixels(getattr(config, "vision_config", None) or config, generator)
    return Probe(inputs, "random")


PROBES = {"causal_lm": causal_lm_probe, "seq2seq_speech": seq2seq_speech_probe, "vision": vision_probe,
          "clip": clip_probe}
# probe kinds whose compared output is a tensor of logits (distribution figures apply)
LOGIT_PROBES = ("causal_lm", "seq2seq_speech")


def _centred(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True)


def _encoder_outputs(outputs, stream_last_hidden_state: bool) -> list[torch.Tensor]:
    """Pooled and last hidden states of an encoder output; the latter centred when it is the raw
    residual stream (CLIP's vision tower returns the stream itself, un-normalised: the conversion
    exactly removes its mean component, so only its centred part can be, and is, preserved)."""
    parts = []
    for key in ("logits", "text_embeds", "image_embeds", "pooler_output", "last_hidden_state"):
        value = outputs.get(key) if hasattr(outputs, "get") else None
        if value is None:
            continue
        parts.append(_centred(value) if key == "last_hidden_state" and stream_last_hidden_state else value)
    return parts


@torch.no_grad()
def model_output(model, probe: Probe, kind: str) -> torch.Tensor:
    """The compared output of ``model`` on ``probe``, as float64.

    ``causal_lm`` and ``seq2seq_speech``: the logits. ``vision``: the logits of a classifier, or
    the last hidden state and pooled output of a bare encoder. ``clip``: CLIPModel's
    logits_per_image, both embeddings and both towers' pooled / last hidden states; a tower
    model's pooled output, projected embeddings and last hidden state (centred for the vision
    tower, whose last hidden state is the raw residual stream). Several parts are flattened and
    concatenated.
    """
    outputs = model(**probe.inputs)
    if kind in LOGIT_PROBES:
        return outputs.logits.double()
    if kind == "vision":
        parts = _encoder_outputs(outputs, stream_last_hidden_state=False)
    elif kind == "clip":
        model_type = getattr(model.config, "model_type", "clip")
        if model_type == "clip":
            parts = [outputs.logits_per_image, outputs.text_embeds, outputs.image_embeds]
            parts += _encoder_outputs(outputs.text_model_output, stream_last_hidden_state=False)
            parts += _encoder_outputs(outputs.vision_model_output, stream_last_hidden_state=True)
        else:
            parts = _encoder_outputs(outputs, stream_last_hidden_state=model_type == "clip_vision_model")
    else:
        raise NormswapError(f"unknown probe kind {kind}")
    return torch.cat([part.double().flatten() for part in parts])


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
