"""Figures and tolerances: what a comparison of two models' outputs on one probe reports.

Both models are run in float32 whatever the checkpoint dtype, so the figures measure the
conversion (the centred and folded weights, rounded to the checkpoint dtype), not runtime rounding.

For language models the figures are max |Δlogit|, the mean KL(original ‖ converted) of the
next-token distributions, top-1 agreement, and the probe perplexity of both. For encoders the
compared output is the family's pooled or last hidden state and only max |Δ| applies.
"""

from __future__ import annotations

import torch

from normswap.errors import NormswapError
from normswap.evaluation.perplexity import exp_or_inf
from normswap.verify.probes import LOGIT_PROBES, Probe

# float64 bytes of logits one step of ``compare_by_sequence`` holds per array
CHUNK_BYTES = 1 << 20


# (atol, rtol) on max |Δoutput| by checkpoint dtype: tolerance = atol + rtol * max |output|.
# fp32: rounding of centred weights is ~1e-7 relative, amplified by depth; 1e-4 absolute is tight
# for GPT-2-small-sized logits. bf16 keeps 8 mantissa bits, so re-rounding the centred weights
# moves each by up to 2^-9 relative and logits by a few 1e-2.
def centred(x: torch.Tensor) -> torch.Tensor:
    """C·x: ``x`` minus its mean over the hidden (last) dimension, in ``x``'s dtype."""
    return x - x.mean(-1, keepdim=True)


def _encoder_outputs(outputs, stream_last_hidden_state: bool, skip: frozenset[str] = frozenset(),
                     prefix: str = "") -> list[torch.Tensor]:
    """Pooled and last hidden states of an encoder output; the latter centred when it is the raw
    residual stream (CLIP's vision tower returns the stream itself, un-normalised: the conversion
    exactly removes its mean component, so only its centred part can be, and is, preserved)."""
    parts = []
    for key in ("logits", "text_embeds", "image_embeds", "pooler_output", "last_hidden_state"):
        value = outputs.get(key) if hasattr(outputs, "get") else None
        if value is None or prefix + key in skip:
            continue
        parts.append(centred(value) if key == "last_hidden_state" and stream_last_hidden_state else value)
    return parts


@torch.no_grad()
def model_output(model: torch.nn.Module, probe: Probe, kind: str, skip: frozenset[str] = frozenset()) -> torch.Tensor:
    """The compared output of ``model`` on ``probe``, as float64.

    ``causal_lm`` and ``seq2seq_speech``: the logits. ``vision``: the logits of a classifier, or
    the last hidden state and pooled output of a bare encoder. ``clip``: CLIPModel's
    logits_per_image, both embeddings and both towers' pooled / last hidden states; a tower
    model's pooled output, projected embeddings and last hidden state (centred for the vision
    tower, whose last hidden state is the raw residual stream). Several parts are flattened and
    concatenated. Outputs named in ``skip`` (``text_model_output.pooler_output``) are left out.
    """
    outputs = model(**probe.inputs)
    if kind in LOGIT_PROBES:
        return outputs.logits.double()
    if kind == "vision":
        parts = _encoder_outputs(outputs, stream_last_hidden_state=False, skip=skip)
    elif kind == "clip":
        model_type = getattr(model.config, "model_type", "clip")
        if model_type == "clip":
            parts = [outputs.logits_per_image, outputs.text_embeds, outputs.image_embeds]
            parts += _encoder_outputs(outputs.text_model_output, False, skip, "text_model_output.")
            parts += _encoder_outputs(outputs.vision_model_output, True, skip, "vision_model_output.")
        else:
            parts = _encoder_outputs(outputs, model_type == "clip_vision_model", skip)
    else:
        raise NormswapError(f"unknown probe kind {kind}")
    return torch.cat([part.double().flatten() for part in parts])


def compare_outputs(reference: torch.Tensor, candidate: torch.Tensor, *, distribution: bool,
                    labels: torch.Tensor | None = None) -> dict:
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


def compare_by_sequence(reference: torch.Tensor, candidate: torch.Tensor, labels: torch.Tensor | None,
                        positions: int | None = None) -> dict:
    """``compare_outputs``'s figures for causal logits [batch, n, vocab], computed ``positions``
    positions of one sequence at a time (default: as many as fit ``CHUNK_BYTES`` of float64 rows).

    A vocabulary-wide float64 comparison of the whole batch holds several [batch, n, vocab]
    arrays at once; this holds a few [positions, vocab] ones, so its memory does not grow with
    the vocabulary beyond a row per array. The merge is exact: maxima are
    maxima; KL and top-1 agreement are means over every position; each perplexity is the exp of
    the mean next-token negative log-likelihood per sequence, and sequences (of equal length)
    combine by their geometric mean, the exp of the mean over all their next-token terms.
    """
    batch, length = reference.shape[:2]
    if positions is None:
        positions = max(1, CHUNK_BYTES // (8 * max(1, reference.shape[-1])))
    totals = dict.fromkeys(("kl", "top1", "nll_reference", "nll_candidate"), 0.0)
    largest = {"max_abs_diff": 0.0, "max_abs_reference": 0.0}
    for index in range(batch):
        for start in range(0, length, positions):
            ref = reference[index, start: start + positions].double()
            cand = candidate[index, start: start + positions].double()
            _chunk_figures(ref, cand, largest, totals)
            if labels is not None:
                following = labels[index, start + 1: start + positions + 1]
                count = following.shape[0]
                for key, logits in (("nll_reference", ref), ("nll_candidate", cand)):
                    picked = torch.log_softmax(logits[:count], dim=-1).gather(-1, following[:, None])
                    totals[key] -= float(picked.sum())
    figures = {**largest, "mean_kl": totals["kl"] / (batch * length),
               "top1_agreement": totals["top1"] / (batch * length)}
    if labels is not None:
        terms = batch * (length - 1)
        figures["perplexity_reference"] = exp_or_inf(totals["nll_reference"] / terms)
        figures["perplexity_candidate"] = exp_or_inf(totals["nll_candidate"] / terms)
    return figures


def _chunk_figures(reference: torch.Tensor, candidate: torch.Tensor, largest: dict, totals: dict) -> None:
    """Fold one chunk of positions (float64 [positions, vocab]) into the running maxima and sums."""
    difference = reference - candidate
    largest["max_abs_diff"] = max(largest["max_abs_diff"], float(difference.abs_().max()))
    largest["max_abs_reference"] = max(largest["max_abs_reference"], float(reference.abs().max()))
    del difference
    log_p, log_q = torch.log_softmax(reference, dim=-1), torch.log_softmax(candidate, dim=-1)
    totals["top1"] += float((reference.argmax(-1) == candidate.argmax(-1)).sum())
    log_q.neg_().add_(log_p)  # log p - log q
    totals["kl"] += float((log_p.exp_() * log_q).sum())


def _perplexity(log_probs: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean next-token negative log-likelihood."""
    picked = log_probs[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return exp_or_inf(float(-picked.mean()))


def within_tolerance(figures: dict, atol: float, rtol: float) -> bool:
    """Whether max |Δ| is within ``atol + rtol * max |reference|``."""
    return figures["max_abs_diff"] <= atol + rtol * figures["max_abs_reference"]
