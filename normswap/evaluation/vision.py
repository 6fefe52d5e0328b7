"""Image evaluation of vision models (ViT, DeiT, DINOv2, BEiT) and image–text models (CLIP).

Images go through the checkpoint's own image processor (``preprocessor_config.json``); CLIP's
texts through its own tokenizer.

* A vision model with a classification head: each image's class distribution (its log-softmax is the
  per-image score the comparison takes differences of), top-1 accuracy when the class subfolders
  name classes of the model's ``id2label``, and, between the two models, top-1 agreement and the
  largest |Δlogit|. One without a head is compared on its pooled output (cosine, max |Δ|).
* CLIP: image–text similarities against one prompt per class (``a photo of a {label}.``), or
  against each image's own file name as caption when there are no class subfolders; zero-shot
  accuracy when labels exist; between the two models, agreement of the best-matching text per
  image, the largest |Δ similarity logit|, and the smallest cosine between their image and text
  embeddings.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from normswap.checkpoint.provenance import original_model_type
from normswap.checkpoint.side_files import MAX_IMAGE_SCALE, reads_any_image_size
from normswap.errors import NormswapError
from normswap.evaluation.media import ImageSet, checkpoint_processor, read_images
from normswap.evaluation.runner import ModelEval

PROMPT = "a photo of a {label}."


def image_processor(path: Path):
    """The checkpoint's own image processor."""
    return checkpoint_processor(path, "AutoImageProcessor", "image", "image processor")


def _names(label: str) -> set[str]:
    # ImageNet-style id2label entries list synonyms: "tabby, tabby cat".
    return {re.sub(r"[\s_-]+", " ", part).strip().lower() for part in label.split(",") if part.strip()}


def class_indices(images: ImageSet, id2label: dict) -> tuple[list[int] | None, str | None]:
    """Model class index of each image's label, or (None, why not)."""
    if images.labels is None:
        return None, "no class subfolders"
    lookup: dict[str, int] = {}
    for index, label in (id2label or {}).items():
        for name in _names(str(label)):
            lookup.setdefault(name, int(index))
    missing = sorted({i.label for i in images.images if _names(str(i.label)).isdisjoint(lookup)})  # type: ignore[arg-type]
    if missing:
        return None, f"class(es) {', '.join(missing[:3])} are not among the model's labels"
    return [next(lookup[n] for n in sorted(_names(str(i.label))) if n in lookup) for i in images.images], None


@dataclass
class ImageData:
    images: ImageSet
    pixel_values: torch.Tensor
    kind: str  # vit | clip
    targets: list[int] | None = None  # class index per image (ViT) or text index per image (CLIP)
    texts: list[str] = field(default_factory=list)  # CLIP only
    text_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    note: str | None = None  # why accuracy is not measured
    family: str = ""  # the checkpoint's model type, which names its measures (dinov2/…)

    @property
    def task(self) -> str:
        return self.family or self.kind

    def describe(self) -> str:
        return self.images.describe()


def prepare(path: Path, spec: str, tokenizer, config: dict, limit: int | None = None) -> ImageData:
    """Read ``spec`` (its first ``limit`` images) and preprocess it for the checkpoint at ``path``,
    one image at a time; pixel values of another shape than the model reads, or not finite, are refused."""
    processor = image_processor(path)

    def pixel_values(image: object) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an overflow shows as non-finite pixels, refused below
            return processor([image], return_tensors="pt").pixel_values[0]

    images = read_images(spec, limit, pixel_values)
    pixels = torch.stack([i.image for i in images.images])
    _check_pixels(pixels, config, path)
    model_type = original_model_type(config)
    if model_type != "clip":
        targets, note = class_indices(images, config.get("id2label") or {})
        return ImageData(images, pixels, "vit", targets, note=note, family=model_type)
    if tokenizer is None:
        raise NormswapError(f"{path} has no tokenizer files; CLIP evaluation needs the checkpoint's tokenizer")
    labels = images.labels
    if labels is not None:
        texts = [PROMPT.format(label=label.replace("_", " ")) for label in labels]
        targets = [labels.index(i.label) for i in images.images]  # type: ignore[arg-type]
    else:
        texts = [re.sub(r"[\s_-]+", " ", i.name).strip() for i in images.images]
        targets = None
    limit = (config.get("text_config") or {}).get("max_position_embeddings", 77)
    text_inputs = dict(tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt"))
    return ImageData(images, pixels, "clip", targets, texts, text_inputs,
                     note=None if labels is not None else "no class subfolders: each image's file name is its caption")


def _check_pixels(pixels: torch.Tensor, config: dict, path: Path) -> None:
    """The processor's pixel values: the model's channels, and its image_size (any size of whole
    patches up to ``MAX_IMAGE_SCALE`` times it, for a family that resamples its positions)."""
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else config
    size, channels = vision.get("image_size"), vision.get("num_channels", 3)
    expected = [channels, *(size if isinstance(size, list) else [size, size])]
    where = path / "preprocessor_config.json"
    if reads_any_image_size(config.get("model_type")) and pixels.shape[1] == channels:
        patch = vision.get("patch_size")
        least = patch if isinstance(patch, list) else [patch, patch]
        most = MAX_IMAGE_SCALE * max(expected[1:])
        if all(isinstance(side, int) for side in (*least, *expected[1:])) and not all(
                low <= side <= most for low, side in zip(least, pixels.shape[2:], strict=True)):
            raise NormswapError(f"{where}: the image processor makes {'x'.join(map(str, pixels.shape[1:]))} pixel "
                                f"values; the model reads images from one {least[0]}x{least[1]} patch up to "
                                f"{most}x{most} pixels")
        expected = list(pixels.shape[1:])
    if list(pixels.shape[1:]) != expected:
        raise NormswapError(f"{where}: the image processor makes {'x'.join(map(str, pixels.shape[1:]))} pixel values, "
                            f"but the model reads {'x'.join(map(str, expected))} (num_channels, image_size)")
    if not bool(torch.isfinite(pixels).all()):
        raise NormswapError(f"{where}: the image processor's normalisation makes non-finite pixel values")


def _device_of(model) -> tuple[torch.device, torch.dtype]:
    parameter = next(model.parameters())
    return parameter.device, parameter.dtype


@torch.no_grad()
def score(model, tokenizer, data: ImageData, result: ModelEval, batch_size: int) -> dict[str, torch.Tensor]:
    """Fill ``result`` with the model's metrics; returns its raw outputs (float64, CPU) for agreement."""
    device, dtype = _device_of(model)
    outputs: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, value: torch.Tensor) -> None:
        outputs.setdefault(name, []).append(value.detach().double().cpu())

    text_inputs = {k: v.to(device) for k, v in data.text_inputs.items()}
    for start in range(0, len(data.pixel_values), batch_size):
        pixels = data.pixel_values[start:start + batch_size].to(device=device, dtype=dtype)
        if data.kind == "clip":
            out = model(pixel_values=pixels, **text_inputs)
            keep("logits", out.logits_per_image)
            keep("image_embeds", out.image_embeds)
            if start == 0:
                keep("text_embeds", out.text_embeds)
        else:
            out = model(pixel_values=pixels)
            logits = getattr(out, "logits", None)
            if logits is not None:
                keep("logits", logits)
            else:
                pooled = getattr(out, "pooler_output", None)
                keep("pooled", pooled if pooled is not None else out.last_hidden_state[:, 0])
                keep("tokens", out.last_hidden_state)
    raw = {name: torch.cat(parts) for name, parts in outputs.items()}
    task = data.task
    if "logits" in raw:
        logprobs = torch.log_softmax(raw["logits"], dim=-1)
        result.per_doc[task] = {i: row.tolist() for i, row in enumerate(logprobs)}
        predictions = raw["logits"].argmax(-1)
        if data.targets is not None:
            metric = "zero_shot_accuracy" if data.kind == "clip" else "accuracy"
            result.metrics[f"{task}/{metric}"] = float((predictions == torch.tensor(data.targets)).double().mean())
        result.details[task] = {"images": len(predictions), "predictions": _predicted_names(model, data, predictions)}
    else:
        result.details[task] = {"images": len(raw["pooled"]), "note": headless_note(data)}
    if data.note and "logits" in raw:
        result.details[task]["note"] = data.note
    return raw


def _predicted_names(model, data: ImageData, predictions: torch.Tensor) -> dict[str, str]:
    if data.kind == "clip":
        names = data.texts
        return {i.name: names[int(p)] for i, p in zip(data.images.images, predictions, strict=True)}
    id2label = getattr(model.config, "id2label", None) or {}
    return {i.name: str(id2label.get(int(p), int(p))) for i, p in zip(data.images.images, predictions, strict=True)}


def _min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def headless_note(data: ImageData) -> str:
    """What the report says of a model without a classifier."""
    return f"{data.task} has no classification head, so there is no accuracy or per-class log-likelihood"


def agreement(original: dict[str, torch.Tensor], converted: dict[str, torch.Tensor], task: str,
              tolerances) -> list[dict[str, Any]]:
    """Rows comparing the two models' outputs directly, each named ``task/measure``."""
    rows = []

    def row(key: str, value: float, limit: str, ok: bool) -> None:
        rows.append({"key": f"{task}/{key}", "value": value, "limit": limit, "ok": bool(ok)})

    top1 = 1 - tolerances.acc_atol
    cos_limit = 1 - tolerances.ppl_rtol
    clip = "image_embeds" in original
    if "logits" in original:
        same = float((original["logits"].argmax(-1) == converted["logits"].argmax(-1)).double().mean())
        row("similarity_agreement" if clip else "top1_agreement", same, f"≥ {top1:g}", same >= top1)
        gap = float((original["logits"] - converted["logits"]).abs().max())
        name = "max_abs_delta_similarity_logit" if clip else "max_abs_delta_logit"
        row(name, gap, f"≤ {tolerances.doc_ll_atol:g}", gap <= tolerances.doc_ll_atol)
    for name in ("image_embeds", "text_embeds", "pooled"):
        if name in original:
            cosine = _min_cosine(original[name], converted[name])
            label = {"image_embeds": "image_embedding", "text_embeds": "text_embedding", "pooled": "pooled_output"}[name]
            row(f"min_cosine_{label}", cosine, f"≥ {cos_limit:g}", cosine >= cos_limit)
    if "pooled" in original:
        gap = float((original["pooled"] - converted["pooled"]).abs().max())
        row("max_abs_delta_pooled_output", gap, f"≤ {tolerances.doc_ll_atol:g}", gap <= tolerances.doc_ll_atol)
    if "tokens" in original:
        cosine = _min_cosine(original["tokens"], converted["tokens"])
        row("min_cosine_token_hidden_state", cosine, f"≥ {cos_limit:g}", cosine >= cos_limit)
        gap = float((original["tokens"] - converted["tokens"]).abs().max())
        row("max_abs_delta_token_hidden_state", gap, f"≤ {tolerances.doc_ll_atol:g}", gap <= tolerances.doc_ll_atol)
    return rows


MAX_IMAGE_ROWS = 50  # per-image rows of a model without a classifier in report.md


def samples(data: ImageData, models: list[ModelEval], raw: list[dict[str, torch.Tensor]] | None = None,
            count: int = 3) -> list[dict[str, Any]]:
    """Rows for the report: for a model with a head, the first ``count`` images with their label and
    each model's prediction; for one without (two models compared), every image (at most
    ``MAX_IMAGE_ROWS``) with the cosine and largest |Δ| of its pooled output and of its tokens'
    hidden states."""
    if raw is not None and len(raw) == 2 and "tokens" in raw[0]:
        return _per_image(data, *raw)
    rows = []
    for image in data.images.images[:count]:
        row = {"image": image.name, "label": image.label or "–"}
        for model in models:
            predictions = model.details.get(data.task, {}).get("predictions")
            if predictions is not None:
                row[model.label] = predictions[image.name]
        rows.append(row)
    return rows


def geometry_batches(model, data: ImageData, batch_size: int):
    """Model inputs for ``normswap geometry``: the images, with CLIP's texts for its text tower."""
    for start in range(0, len(data.pixel_values), batch_size):
        batch: dict[str, torch.Tensor] = {"pixel_values": data.pixel_values[start:start + batch_size]}
        if data.kind == "clip" and start == 0:
            # The text tower runs once on the prompts; later batches go through the image tower only.
            batch.update(data.text_inputs)
        yield batch


def _per_image(data: ImageData, original: dict[str, torch.Tensor], converted: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    cosine = torch.nn.functional.cosine_similarity
    rows = []
    for index, image in enumerate(data.images.images[:MAX_IMAGE_ROWS]):
        a, b = original["tokens"][index], converted["tokens"][index]
        row: dict[str, Any] = {"image": image.name}
        if data.images.labels is not None:
            row["label"] = image.label
        row.update({
            "pooled cosine": float(cosine(original["pooled"][index], converted["pooled"][index], dim=-1)),
            "pooled max abs Δ": float((original["pooled"][index] - converted["pooled"][index]).abs().max()),
            "min token cosine": float(cosine(a, b, dim=-1).min()),
            "token max abs Δ": float((a - b).abs().max()),
        })
        rows.append(row)
    return rows
