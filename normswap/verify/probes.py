"""Probes: the inputs both models of a comparison run on, built for each family's kind of model.

Token ids come from real English text through the checkpoint's tokenizer when it has one (so the
perplexity figures mean something), and are random otherwise; images and audio features are
random at the scale of normalised inputs. Every random part is drawn from one seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from normswap.runtime.reference import load_tokenizer, tokenize_text

# Once the weights are proven (``proof``), a forward pass only has to show that a loader builds a
# model computing the function: a short probe does (see docs/verification.md).
PROBE_TOKENS = 16
PROBE_BATCH = 1


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


def token_ids(vocab_size: int, length: int, tokenizer: Any, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """Ids [PROBE_BATCH, length] and their kind: the probe text through ``tokenizer`` when there is
    one and the text is long enough, else ids drawn uniformly from the vocabulary."""
    if tokenizer is not None:
        ids = tokenize_text(tokenizer, probe_text())  # longer than the context on purpose: no warning
        if ids.numel() >= PROBE_BATCH * length:
            return ids[: PROBE_BATCH * length].reshape(PROBE_BATCH, length), "text"
    return torch.randint(0, int(vocab_size), (PROBE_BATCH, length), generator=generator), "random"


def _context(config) -> int:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
    return min(PROBE_TOKENS, int(limit))


def causal_lm_probe(config: Any, tokenizer: Any, seed: int = 0) -> Probe:
    """Token ids [PROBE_BATCH, n] and their attention mask."""
    ids, kind = token_ids(config.vocab_size, _context(config), tokenizer, torch.Generator().manual_seed(seed))
    return Probe({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, kind)


def seq2seq_speech_probe(config: Any, tokenizer: Any, seed: int = 0) -> Probe:
    """Whisper: random log-mel features and decoder ids.

    The encoder insists on exactly 2·max_source_positions frames (its second conv has stride 2);
    features are N(0, 1), the scale of Whisper's normalised log-mel input.
    """
    generator = torch.Generator().manual_seed(seed)
    frames = 2 * int(config.max_source_positions)
    features = torch.randn(PROBE_BATCH, int(config.num_mel_bins), frames, generator=generator)
    length = min(PROBE_TOKENS, int(config.max_target_positions))
    ids, kind = token_ids(config.vocab_size, length, tokenizer, generator)
    return Probe({"input_features": features, "decoder_input_ids": ids}, kind)


def seq2seq_text_probe(config: Any, tokenizer: Any, seed: int = 0) -> Probe:
    """A text encoder-decoder: the same ids [PROBE_BATCH, n] into the encoder and the decoder."""
    ids, kind = token_ids(config.vocab_size, _context(config), tokenizer, torch.Generator().manual_seed(seed))
    return Probe({"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": ids}, kind)


def _pixels(vision_config, generator: torch.Generator) -> torch.Tensor:
    size = vision_config.image_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels = int(getattr(vision_config, "num_channels", 3))
    return torch.randn(PROBE_BATCH, channels, int(height), int(width), generator=generator)


def vision_probe(config: Any, tokenizer: Any, seed: int = 0) -> Probe:
    """Random N(0, 1) pixel values [PROBE_BATCH, channels, size, size] (normalised-image scale)."""
    return Probe({"pixel_values": _pixels(config, torch.Generator().manual_seed(seed))}, "random")


def clip_probe(config: Any, tokenizer: Any, seed: int = 0) -> Probe:
    """Token ids ending in the end-of-text token (the CLIP text tower pools there) and/or pixels.

    ``clip`` configs get both, ``clip_text_model`` ids only, ``clip_vision_model`` pixels only.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    model_type = getattr(config, "model_type", "clip")
    if model_type != "clip_vision_model":
        text = getattr(config, "text_config", None) or config
        length = min(PROBE_TOKENS, int(text.max_position_embeddings))
        ids, _ = token_ids(text.vocab_size, length, None, generator)
        eos = getattr(text, "eos_token_id", None)
        if isinstance(eos, int) and 0 <= eos < text.vocab_size:
            ids[:, -1] = eos
        inputs["input_ids"] = ids
    if model_type != "clip_text_model":
        inputs["pixel_values"] = _pixels(getattr(config, "vision_config", None) or config, generator)
    return Probe(inputs, "random")


PROBES = {"causal_lm": causal_lm_probe, "seq2seq_speech": seq2seq_speech_probe, "vision": vision_probe,
          "clip": clip_probe, "seq2seq_text": seq2seq_text_probe}
# probe kinds whose compared output is a tensor of logits (distribution figures apply)
LOGIT_PROBES = ("causal_lm", "seq2seq_speech", "seq2seq_text")


def build_probe(kind: str, config: Any, checkpoint: Path) -> Probe:
    """The probe of ``kind`` for a model of ``config``, with the tokenizer of ``checkpoint``."""
    return PROBES[kind](config, load_tokenizer(checkpoint, config.to_dict()))
