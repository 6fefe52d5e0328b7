"""Calibration inputs of the models that do not read text, for ``rotate --method pca``.

The rotated stream's principal directions are measured on what the model reads, through the
checkpoint's own processors (``normswap.rotate.calibration`` runs them block by block):

* Whisper (its decoder stream rotates): transcribed audio, as ``eval --audio`` reads it: a folder
  of audio files with same-stem ``.txt`` transcripts, a JSONL manifest, or ``bundled`` (the six
  short English utterances that ship with normswap). The encoder runs on each utterance's log-mel
  features (the checkpoint's feature extractor) and the decoder reads the utterance's transcript
  tokens after the decoder prompt, teacher-forced, so every decoder position is one the model
  sees when it transcribes that audio. Text alone cannot calibrate it: the decoder stream depends
  on the audio through cross-attention, and no audio stands in for none.
* ViT: images, as ``eval --images`` reads them (a file, a folder, a folder of class subfolders,
  or ``bundled``), through the checkpoint's image processor.
* CLIP (its text tower rotates): text, as for a causal language model (``bundled`` is the
  held-out Persuasion excerpt).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from normswap.architectures import ARCHITECTURES
from normswap.checkpoint.provenance import original_model_type
from normswap.checkpoint.source import CheckpointReader
from normswap.errors import NormswapError
from normswap.evaluation import audio, media
from normswap.evaluation.text import text_file
from normswap.rotate.calibration import CalibrationInputs
from normswap.runtime.reference import load_tokenizer

KINDS = {"audio": "a folder of audio files with same-stem .txt transcripts, a JSONL manifest of "
                  '{"audio": FILE, "text": TRANSCRIPT} lines, or \'bundled\' (the bundled utterances)',
         "images": "an image file, a folder of images or of class subfolders, or 'bundled' (the bundled images)"}


def _kind(config: dict) -> str:
    """What the rotated stream of a model of ``config`` is calibrated on: audio, images or text."""
    model_type = str(original_model_type(config))
    architecture = ARCHITECTURES.get(model_type)
    return architecture.calibration_modality(model_type) if architecture is not None else "text"


class MediaInputs:
    """The ``MediaCalibration`` of normswap's public API: text, audio or images by model kind."""

    def resolve(self, config: dict, spec: str) -> str:

        kind, model_type = _kind(config), original_model_type(config)
        if kind == "text":
            return str(text_file(spec))
        if spec != media.BUNDLED and Path(spec).expanduser().suffix.lower() == ".txt":
            raise NormswapError(f"--calibration: a {model_type} model is calibrated on {kind}, not text; pass "
                                f"{KINDS[kind]}")
        (audio.check_audio if kind == "audio" else media.check_images)(spec)
        return spec

    def inputs(self, source_dir: Path, config: dict, spec: str, max_tokens: int) -> CalibrationInputs:
        if _kind(config) == "audio":
            return speech_inputs(source_dir, config, spec, max_tokens)
        return image_inputs(source_dir, config, spec, max_tokens)


def _digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of the model inputs themselves (float32 features or pixels, int64 ids)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def speech_inputs(source_dir: Path, config: dict, spec: str, max_tokens: int) -> CalibrationInputs:
    """One batch per utterance: its log-mel features and its decoder prompt and transcript tokens
    (the labels without the final end of text, as teacher forcing feeds them)."""
    from normswap.evaluation import speech

    data = speech.prepare(source_dir, spec, load_tokenizer(source_dir, config), config, max_tokens)
    batches, tokens, used = [], 0, []
    for features, labels in zip(data.features, data.labels, strict=True):
        if tokens >= max_tokens:
            break
        ids = torch.tensor([labels[:-1] if len(labels) > 1 else labels], dtype=torch.long)
        batches.append({"input_features": features.unsqueeze(0).float(), "decoder_input_ids": ids})
        tokens += ids.numel()
        used += [batches[-1]["input_features"], ids]
    record = {"audio": data.audio.name, "utterances": len(batches), "tokens": tokens,
              "seconds": round(sum(u.seconds for u in data.audio.utterances[:len(batches)]), 2),
              "inputs_sha256": _digest(used)}
    return CalibrationInputs(batches, tokens, record)


def image_inputs(source_dir: Path, config: dict, spec: str, max_tokens: int, batch: int = 8) -> CalibrationInputs:
    """Batches of ``batch`` images' pixel values; each image gives every position the model runs
    (its patches and the class and distillation tokens). Only the images the cap needs are read."""
    from normswap.evaluation import vision

    per_image = positions_per_image(source_dir, config)
    data = vision.prepare(source_dir, spec, None, config, limit=max(1, -(-max_tokens // per_image)))
    pixels = data.pixel_values.float()
    count = len(pixels)
    batches = [{"pixel_values": pixels[start:start + batch]} for start in range(0, count, batch)]
    record = {"images": data.images.name, "count": count, "tokens": count * per_image,
              "inputs_sha256": _digest([pixels])}
    return CalibrationInputs(batches, count * per_image, record)


def positions_per_image(source_dir: Path, config: dict) -> int:
    """The positions a vision model's stream holds per image: (image_size / patch_size)² patches and
    the tokens before them, counted from the position table's length (ViT's class token, DeiT's class
    and distillation tokens); one class token where the model has no absolute position table."""

    size, patch = config.get("image_size"), config.get("patch_size")
    if not isinstance(size, int) or not isinstance(patch, int) or patch <= 0 or size < patch:
        raise NormswapError("the model's config states no image_size and patch_size")
    patches = (size // patch) ** 2
    with CheckpointReader(source_dir) as reader:
        tables = [info.shape for name, info in reader.tensors.items() if name.endswith("embeddings.position_embeddings")]
    length = tables[0][-2] if tables and len(tables[0]) >= 2 else None
    return patches + (length - patches if isinstance(length, int) and patches < length <= patches + 8 else 1)
