"""Speech evaluation of sequence-to-sequence speech models (Whisper) on transcribed audio.

For each model, through the checkpoint's own feature extractor and tokenizer:

* teacher-forced scoring: every utterance's transcript is scored given its audio; the
  log-likelihood of the transcript tokens (after the decoder prompt: start of transcript,
  language, task, no-timestamps) gives the token perplexity and the per-utterance
  log-likelihood that the comparison takes differences of;
* greedy decoding (``generate`` with one beam, no sampling) and the word error rate of the decoded
  text against the transcripts, computed by ``jiwer`` after lower-casing and removing punctuation.

The comparison adds the fraction of utterances whose decoded text is identical for both models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from normswap.errors import NormswapError
from normswap.evaluation.audio import AudioSet, read_audio, transcripts
from normswap.evaluation.media import checkpoint_processor
from normswap.evaluation.perplexity import exp_or_inf
from normswap.evaluation.runner import ModelEval

TASK = "speech"


FEATURE_BATCH = 16  # utterances padded and turned into log-mel features at a time


def feature_extractor(path: Path):
    """The checkpoint's own feature extractor (``preprocessor_config.json``), a Whisper one."""
    extractor = checkpoint_processor(path, "AutoFeatureExtractor", "speech", "feature extractor")
    if type(extractor).__name__ != "WhisperFeatureExtractor":
        raise NormswapError(f"{path / 'preprocessor_config.json'} builds a {type(extractor).__name__}; a Whisper "
                            "model reads the log-mel features of a WhisperFeatureExtractor")
    return extractor


def wer_transform():
    """jiwer's normalisation used for WER: lower case, no punctuation, single spaces."""
    import jiwer

    return jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(),
                          jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER of ``hypotheses`` against ``references`` (jiwer, normalised as ``wer_transform``)."""
    try:
        import jiwer
    except ImportError:
        raise NormswapError("word error rates need jiwer: pip install 'normswap[eval]'") from None
    transform = wer_transform()
    return float(jiwer.wer(references, hypotheses, reference_transform=transform, hypothesis_transform=transform))


@dataclass
class SpeechData:
    """The audio set as model inputs: log-mel features and tokenised transcripts."""

    audio: AudioSet
    features: torch.Tensor  # [utterances, mel bins, frames]
    labels: list[list[int]]  # decoder start, prompt, transcript tokens, end of text
    prompt_length: list[int]  # leading prompt tokens of each label, not scored

    def describe(self) -> str:
        return self.audio.describe()


def prepare(path: Path, spec: str, tokenizer, config: dict, max_tokens: int | None = None) -> SpeechData:
    """Read ``spec`` at the feature extractor's rate; features and labels for every utterance, or
    for the fewest first ones whose decoder inputs reach ``max_tokens`` (only those are decoded)."""
    if tokenizer is None:
        raise NormswapError(f"{path} has no tokenizer files; speech input needs the checkpoint's tokenizer")
    extractor = feature_extractor(path)
    labels, prompts = _labels(transcripts(spec), tokenizer, config, max_tokens)
    audio = read_audio(spec, int(extractor.sampling_rate), float(extractor.chunk_length), len(labels))
    features = None
    for start in range(0, len(audio.utterances), FEATURE_BATCH):
        batch = audio.utterances[start:start + FEATURE_BATCH]
        rows = extractor([u.audio for u in batch], sampling_rate=extractor.sampling_rate,
                         return_tensors="pt").input_features
        for utterance, row in zip(batch, rows, strict=True):
            if not torch.isfinite(row).all():
                raise NormswapError(f"the log-mel features of utterance {utterance.name!r} are not finite: its "
                                    f"samples or the settings of {path / 'preprocessor_config.json'} overflow")
        if features is None:  # filled batch by batch: no second copy of every utterance's features
            features = torch.empty((len(audio.utterances), *rows.shape[1:]), dtype=rows.dtype)
        features[start:start + len(batch)] = rows
    return SpeechData(audio, features, labels, prompts)


def _labels(texts: list[str], tokenizer, config: dict, max_tokens: int | None) -> tuple[list[list[int]], list[int]]:
    """Each transcript's labels (decoder start, prompt, transcript tokens, end of text) and prompt
    length, up to the first whose decoder inputs bring the total to ``max_tokens``."""
    start = config.get("decoder_start_token_id")
    eos = config.get("eos_token_id")
    limit = int(config.get("max_target_positions") or 448)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    labels, prompts, tokens = [], [], 0
    for text in texts:
        if max_tokens is not None and tokens >= max_tokens:
            break
        ids = list(tokenizer(text).input_ids)
        if start is not None and (not ids or ids[0] != start):
            ids.insert(0, start)
        if eos is not None and ids[-1] != eos:
            ids.append(eos)
        ids = ids[: limit + 1]
        prompt = 1
        while prompt < len(ids) - 1 and ids[prompt] in special:
            prompt += 1
        labels.append(ids)
        prompts.append(prompt)
        tokens += max(1, len(ids) - 1)
    return labels, prompts


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def transcript_loglikelihoods(model, data: SpeechData, batch_size: int) -> list[tuple[float, int]]:
    """(log-likelihood in nats, tokens scored) of each transcript given its audio, teacher-forced."""
    device, dtype = _device_of(model), next(model.parameters()).dtype
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    results = []
    for start in range(0, len(data.labels), batch_size):
        labels = data.labels[start:start + batch_size]
        width = max(len(ids) for ids in labels) - 1
        inputs = torch.full((len(labels), width), pad, dtype=torch.long)
        for row, ids in enumerate(labels):
            inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        features = data.features[start:start + batch_size].to(device=device, dtype=dtype)
        # Right padding: a causal decoder's real positions never see the padding after them.
        logits = model(input_features=features, decoder_input_ids=inputs.to(device)).logits
        logprobs = torch.log_softmax(logits.double(), dim=-1).cpu()
        for row, ids in enumerate(labels):
            first = data.prompt_length[start + row]
            targets = torch.tensor(ids[first:])
            scored = logprobs[row, first - 1: len(ids) - 1].gather(-1, targets[:, None])
            results.append((float(scored.sum()), int(targets.numel())))
    return results


@torch.no_grad()
def greedy_transcripts(model, tokenizer, data: SpeechData, batch_size: int) -> list[str]:
    """Greedy decoding (one beam, no sampling) of every utterance, special tokens removed."""
    device, dtype = _device_of(model), next(model.parameters()).dtype
    limit = int(getattr(model.config, "max_target_positions", 448) or 448)
    longest = max(len(ids) for ids in data.labels)
    max_new = max(1, min(limit - max(data.prompt_length) - 1, 2 * longest + 16))
    texts = []
    for start in range(0, len(data.labels), batch_size):
        features = data.features[start:start + batch_size].to(device=device, dtype=dtype)
        sequences = model.generate(input_features=features, max_new_tokens=max_new, do_sample=False, num_beams=1)
        if not isinstance(sequences, torch.Tensor):
            sequences = sequences.sequences
        texts += [t.strip() for t in tokenizer.batch_decode(sequences, skip_special_tokens=True)]
    return texts


def score(model, tokenizer, data: SpeechData, result: ModelEval, batch_size: int) -> None:
    """Fill ``result`` with the speech metrics of ``model``."""
    scores = transcript_loglikelihoods(model, data, batch_size)
    total_ll = sum(ll for ll, _ in scores)
    total_tokens = sum(n for _, n in scores)
    decodes = greedy_transcripts(model, tokenizer, data, batch_size)
    references = [u.text for u in data.audio.utterances]
    result.metrics[f"{TASK}/token_perplexity"] = exp_or_inf(-total_ll / total_tokens)
    result.metrics[f"{TASK}/wer"] = word_error_rate(references, decodes)
    result.per_doc[TASK] = {i: [ll] for i, (ll, _) in enumerate(scores)}
    result.details[TASK] = {"utterances": len(scores), "tokens_scored": total_tokens,
                            "decodes": dict(zip([u.name for u in data.audio.utterances], decodes, strict=True))}


def agreement(original: ModelEval, converted: ModelEval, tolerances) -> list[dict[str, Any]]:
    """Rows comparing the two models' outputs directly: identical greedy decodes."""
    a = original.details[TASK]["decodes"]
    b = converted.details[TASK]["decodes"]
    same = sum(a[name] == b.get(name) for name in a) / max(1, len(a))
    return [{"key": f"{TASK}/identical_decodes", "value": same, "limit": f"≥ {1 - tolerances.acc_atol:g}",
             "ok": same >= 1 - tolerances.acc_atol}]


def samples(data: SpeechData, models: list[ModelEval], count: int = 3) -> list[dict[str, str]]:
    """The first ``count`` utterances: reference and each model's decode, for the report."""
    rows = []
    for utterance in data.audio.utterances[:count]:
        row = {"utterance": utterance.name, "reference": utterance.text}
        for model in models:
            row[model.label] = model.details[TASK]["decodes"][utterance.name]
        rows.append(row)
    return rows


def geometry_batches(model, data: SpeechData, batch_size: int):
    """Model inputs for ``normswap geometry``: the audio to the encoder, the transcript to the decoder."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    for start in range(0, len(data.labels), batch_size):
        labels = data.labels[start:start + batch_size]
        if len({len(ids) for ids in labels}) > 1:
            # Unequal transcripts go one by one: padding would be measured as if it were text.
            for offset, ids in enumerate(labels):
                yield {"input_features": data.features[start + offset: start + offset + 1],
                       "decoder_input_ids": torch.tensor([ids[:-1]])}
            continue
        inputs = torch.full((len(labels), len(labels[0]) - 1), pad, dtype=torch.long)
        for row, ids in enumerate(labels):
            inputs[row] = torch.tensor(ids[:-1])
        yield {"input_features": data.features[start:start + batch_size], "decoder_input_ids": inputs}
