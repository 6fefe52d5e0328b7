"""``normswap eval --audio`` / ``--images``: speech and vision models, original and converted side by side.

The inputs are read and preprocessed once, with the processor of the first checkpoint (the
original when there is one), and given unchanged to every model. Scores become the same
``ModelEval`` records as text evaluation, so metrics and per-utterance / per-image scores are
compared under the same tolerances; outputs the two models can be compared on directly (identical
decodes, top-1 agreement, embedding cosines) are added as ``agreement`` rows, and the verdict
needs both.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from normswap.checkpoint.source import read_config, resolve_source
from normswap.errors import NormswapError
from normswap.evaluation import audio, media
from normswap.evaluation.compare import Tolerances, compare, default_tolerances
from normswap.evaluation.report import build_report
from normswap.evaluation.runner import EvalSettings, ModelEval, parse_dtype, release_memory
from normswap.runtime.reference import load_tokenizer


def media_kind(settings: EvalSettings) -> str | None:
    """``audio``, ``images`` or None (text) from the settings; both at once is an error."""
    audio, images = getattr(settings, "audio", None), getattr(settings, "images", None)
    if audio and images:
        raise NormswapError("pass --audio or --images, not both: a model reads one kind of input")
    return "audio" if audio else "images" if images else None


def check_sources(sources: list[str], kind: str | None, trust_remote_code: bool, *,
                  causal_text: bool = False) -> list[Path]:
    """Resolve every checkpoint and check that it reads ``kind`` (and, with ``causal_text``, that
    a text model is a causal LM, whose scores text evaluation takes); one line otherwise."""

    paths = []
    for source in sources:
        path = resolve_source(source, trust_remote_code=trust_remote_code)
        config = read_config(path)
        media.require_modality(config, source, kind)
        if causal_text and config.get("is_encoder_decoder"):
            raise NormswapError(
                f"{source} is a {config.get('model_type')} encoder-decoder: text evaluation scores a causal "
                "language model (perplexity, lm-eval log-likelihoods of continuations), which it is not; "
                "`normswap verify` compares its logits and `normswap geometry --text` reads it")
        paths.append(path)
    return paths


def _task(kind: str, config: dict):
    if kind == "audio":
        from normswap.evaluation import speech

        return speech
    from normswap.evaluation import vision

    return vision


def _load(path: Path, settings: EvalSettings):
    from normswap import load_model

    kwargs: dict[str, Any] = {"dtype": parse_dtype(settings.dtype), "trust_remote_code": settings.trust_remote_code}
    if settings.device_map:
        kwargs["device_map"] = settings.device_map
    model, tokenizer = load_model(path, **kwargs)
    if not settings.device_map:
        model = model.to(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return model.eval(), tokenizer


def evaluate_media(
    model: str,
    *,
    baseline: str | None = None,
    settings: EvalSettings,
    tolerances: Tolerances | None = None,
    reference: dict[str, float] | None = None,
    reference_source: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (and ``baseline``) on ``settings.audio`` or ``settings.images``; the report."""

    kind = media_kind(settings)
    assert kind is not None
    spec = settings.audio if kind == "audio" else settings.images
    (audio.check_audio if kind == "audio" else media.check_images)(spec)
    labelled = [("original", baseline), ("converted", model)] if baseline is not None else [("model", model)]
    paths = check_sources([source for _, source in labelled], kind, settings.trust_remote_code)
    config = read_config(paths[0])
    task = _task(kind, config)
    data = task.prepare(paths[0], spec, load_tokenizer(paths[0]), config)

    results: list[ModelEval] = []
    raw: list[Any] = []
    for (label, source), path in zip(labelled, paths, strict=True):
        started = time.perf_counter()
        result = ModelEval(label=label, source=str(source))
        loaded, tokenizer = _load(path, settings)
        try:
            raw.append(task.score(loaded, tokenizer or load_tokenizer(paths[0]), data, result, settings.batch_size))
        finally:
            del loaded
            release_memory()
        result.details["seconds"] = round(time.perf_counter() - started, 2)
        results.append(result)

    comparison = None
    agreement: list[dict[str, Any]] = []
    if baseline is not None:
        tolerances = tolerances or default_tolerances(settings.dtype)
        comparison = compare(results[0], results[1], tolerances)
        if kind == "audio":
            agreement = task.agreement(results[0], results[1], tolerances)
        else:
            agreement = task.agreement(raw[0], raw[1], data.task, tolerances)
    report = build_report(
        results, settings, comparison=comparison, reference=reference, reference_source=reference_source,
        text={"name": data.describe()},
        extra={"modality": kind, "agreement": agreement or None, "unscored": _unscored(results),
               "samples": task.samples(data, results) if kind == "audio" else task.samples(data, results, raw)},
    )
    if comparison is not None and not all(row["ok"] for row in agreement):
        report["verdict"] = "fail"
    return report


def _unscored(results: list[ModelEval]) -> str | None:
    """Why no model has a score to compare (a vision backbone without a head), or None."""
    if any(result.metrics or result.per_doc for result in results):
        return None
    return next((details["note"] for result in results for details in result.details.values()
                 if isinstance(details, dict) and details.get("note")), "no model has a score")
