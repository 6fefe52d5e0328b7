"""Strided sliding-window perplexity, the recipe of the transformers documentation.

The text is tokenised once. Windows of ``max_length`` tokens start every ``stride`` tokens; each
window scores only the tokens no earlier window scored, so every token is predicted once, from up
to ``max_length - 1`` tokens of context:

    window k covers tokens [b_k, e_k) with b_k = k * stride, e_k = min(b_k + max_length, N)
    it scores token t for max(e_{k-1}, b_k + 1) <= t < e_k          (e_{-1} = 0)
    PPL = exp( -(1/T) * sum_t log p(x_t | x_{b_k} .. x_{t-1}) )

The first token of the text has no context and is never scored; with ``stride == max_length``
the first token of each window is not scored either (exactly as in the documentation, which is
how GPT-2's published 29.94 on WikiText-2 at stride 1024 was measured). The documentation's code
counts ``valid labels - batch size`` per window; we count the scored tokens exactly, which is the
same when ``stride == max_length`` and one token per window more accurate otherwise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from normswap.errors import NormswapError
from normswap.runtime.reference import config_context_length


@dataclass
class Window:
    """One forward pass: tokens [begin, end) in, log-probabilities of tokens [score_from, end) out."""

    begin: int
    end: int
    score_from: int


@dataclass
class StridedResult:
    """Strided perplexity and the counts behind it (``nll_sum`` in nats, summed in float64)."""

    token_perplexity: float
    nll_sum: float
    n_tokens: int
    n_windows: int
    max_length: int
    stride: int
    window_nll: list[float] = field(default_factory=list, repr=False)  # per window, for comparisons

    def as_dict(self) -> dict[str, float | int]:
        """The summary figures (without the per-window list)."""
        return {k: v for k, v in asdict(self).items() if k != "window_nll"}


def plan_windows(n_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The windows of the strided recipe over ``n_tokens`` tokens (see the module docstring)."""
    if max_length < 2:
        raise NormswapError(f"--max-length must be at least 2 (got {max_length})")
    if not 1 <= stride <= max_length:
        raise NormswapError(f"--stride must be between 1 and --max-length={max_length} (got {stride})")
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        score_from = max(prev_end, begin + 1)
        if score_from < end:
            windows.append(Window(begin, end, score_from))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def model_max_length(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's position scheme allows, read from its config."""

    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    return config_context_length(to_dict()) if callable(to_dict) else None


def _batches(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of equal length, at most ``batch_size`` at a time (no padding needed)."""
    batches: list[list[Window]] = []
    for window in windows:
        last = batches[-1] if batches else None
        if (
            last is not None
            and len(last) < batch_size
            and last[0].end - last[0].begin == window.end - window.begin
        ):
            last.append(window)
        else:
            batches.append([window])
    return batches


def _input_device(model: torch.nn.Module) -> torch.device:
    # With device_map="auto" the embeddings sit on the first device; HF models expose it as .device.
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


@torch.inference_mode()
def exp_or_inf(value: float) -> float:
    """``math.exp(value)``, inf where it overflows: a perplexity of text the model finds hopeless."""
    return math.exp(value) if value < 709.0 else math.inf


def strided_perplexity(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    max_length: int,
    stride: int,
    batch_size: int = 1,
    progress: bool = False,
) -> StridedResult:
    """Strided perplexity of a causal LM over one token sequence (1-D ``input_ids``).

    Token losses are ``cross_entropy`` in at least float32 (the precision of the HF loss; a float64
    model keeps float64) and are summed in float64, so the total does not drift over hundreds of
    thousands of tokens.
    """
    ids = input_ids.reshape(-1).long()
    windows = plan_windows(ids.numel(), max_length, stride)
    if not windows:
        raise NormswapError("the text is too short to score (it needs at least two tokens)")
    device = _input_device(model)
    window_nll: list[float] = []
    n_scored = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(windows), desc="strided perplexity", unit="window", leave=False)
    for batch in _batches(windows, batch_size):
        tokens = torch.stack([ids[w.begin : w.end] for w in batch]).to(device)
        logits = model(input_ids=tokens).logits
        for row, window in enumerate(batch):
            # Position j predicts token j + 1; only the positions whose targets are new are scored.
            first = window.score_from - window.begin - 1
            predictions = logits[row, first:-1]
            if predictions.dtype in (torch.float16, torch.bfloat16):
                predictions = predictions.float()
            targets = tokens[row, first + 1 :].to(predictions.device)
            nll = F.cross_entropy(predictions, targets, reduction="none")
            window_nll.append(nll.double().sum().item())
            n_scored += window.end - window.score_from
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    nll_sum = math.fsum(window_nll)
    return StridedResult(
        token_perplexity=exp_or_inf(nll_sum / n_scored),
        nll_sum=nll_sum,
        n_tokens=n_scored,
        n_windows=len(windows),
        max_length=max_length,
        stride=stride,
        window_nll=window_nll,
    )


