"""An lm-eval ``HFLM`` that runs each shared context once and the output head only where it scores.

lm-eval scores a loglikelihood request ``(context, continuation)`` by running the model over
``(context + continuation)[:-1]`` and reading the log-probabilities of the continuation tokens.
A multiple-choice document sends one request per choice with the same context, so the context is
run once per choice, and the output head and log-softmax run over every position although only
the continuation's are read.

``SharedContextHFLM`` overrides HFLM's ``_loglikelihood_tokens`` only. Requests are grouped by
context. For each group the context minus its last token (the *prefix*) runs once with a
key/value cache and no head beyond one position; the cache is then repeated per request, and each
request's *suffix* ``[context[-1]] + continuation[:-1]`` runs on it, with the head on the suffix
positions only: exactly the positions HFLM scores. Prefixes are left-padded (as for batched
generation) with an attention mask and explicit position ids, so every token sees the same keys
at the same positions as in HFLM's forward pass; only float rounding differs.

A request whose context no other request shares (a last-word task, a rolling window), or whose
context is one token, has nothing to share: it runs in one pass over
``(context + continuation)[:-1]``, as in HFLM, but left-padded among rows of similar length and
with the head on its continuation's positions only. Either way the log-softmax runs on the scored
positions only, a few at a time (``continuation_scores``).

Anything not handled exactly like lm-eval goes to HFLM's own path, per request: requests left-
truncated to ``max_length``, encoder-decoder models, families whose adapter does not declare
``shared_context``, ``batch_size="auto"``, and runs with ``share_contexts=False``.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from normswap.architectures import ARCHITECTURES

Request = tuple[tuple[str, str] | None, list[int], list[int]]


@dataclass
class ContextGroup:
    """Requests sharing one context: the prefix runs once, each request's suffix on its cache."""

    prefix: list[int]
    indices: list[int] = field(default_factory=list)  # positions in the request list
    suffixes: list[list[int]] = field(default_factory=list)  # [context[-1]] + continuation[:-1]
    continuations: list[list[int]] = field(default_factory=list)


def group_requests(requests: list[Request], max_length: int) -> tuple[list[ContextGroup], list[ContextGroup],
                                                                     list[int]]:
    """Requests sorted three ways: groups sharing a context of two tokens or more (longest prefix
    first), requests alone with their context (one group each), and the indices of requests left
    to HFLM's own path (left-truncated to ``max_length``, or with nothing to score)."""
    groups: dict[tuple[int, ...], ContextGroup] = {}
    plain: list[int] = []
    for index, (_, context, continuation) in enumerate(requests):
        if not context or not continuation or len(context) + len(continuation) > max_length + 1:
            plain.append(index)
            continue
        key = tuple(context)
        group = groups.get(key)
        if group is None:
            group = groups[key] = ContextGroup(prefix=list(context[:-1]))
        group.indices.append(index)
        group.suffixes.append([context[-1], *continuation[:-1]])
        group.continuations.append(list(continuation))
    shared = sorted((g for g in groups.values() if len(g.indices) > 1 and g.prefix),
                    key=lambda g: (-len(g.prefix), g.prefix))
    lone = [ContextGroup(g.prefix, [index], [suffix], [continuation]) for g in groups.values()
            if len(g.indices) == 1 or not g.prefix
            for index, suffix, continuation in zip(g.indices, g.suffixes, g.continuations, strict=True)]
    return shared, lone, plain


def batches(groups: list[ContextGroup], token_budget: int, max_length: int) -> Iterator[list[ContextGroup]]:
    """Consecutive runs of groups whose padded prefixes hold at most ``token_budget`` tokens and
    whose padded prefix plus longest suffix fit in ``max_length`` positions (some families size
    their masks by the context). ``groups`` come longest prefix first, so the first sets the width."""
    batch: list[ContextGroup] = []
    prefix_width = suffix_width = 0
    for group in groups:
        longest = max(len(suffix) for suffix in group.suffixes)
        width = max(prefix_width, len(group.prefix))
        too_many = (len(batch) + 1) * width > token_budget
        if batch and (too_many or width + max(suffix_width, longest) > max_length):
            yield batch
            batch, prefix_width, suffix_width = [], 0, 0
        batch.append(group)
        prefix_width = max(prefix_width, len(group.prefix))
        suffix_width = max(suffix_width, longest)
    if batch:
        yield batch


def lone_batches(groups: list[ContextGroup], token_budget: int) -> Iterator[list[ContextGroup]]:
    """One-request groups, longest row first, in runs whose padded rows hold at most
    ``token_budget`` tokens (at least one row per run)."""
    ordered = sorted(groups, key=lambda g: -(len(g.prefix) + len(g.suffixes[0])))
    start = 0
    while start < len(ordered):
        width = len(ordered[start].prefix) + len(ordered[start].suffixes[0])
        stop = start + max(1, token_budget // width)
        yield ordered[start:stop]
        start = stop


def suffix_chunks(lengths: list[int], rows_per_chunk: int) -> list[list[int]]:
    """Row indices sorted by suffix length (longest first) in chunks of ``rows_per_chunk``, so each
    chunk pads to similar lengths."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    step = max(1, rows_per_chunk)
    return [order[start:start + step] for start in range(0, len(order), step)]


def _repeated_cache(cache, rows: torch.Tensor):
    """A copy of ``cache`` holding batch entries ``rows`` (repeats allowed); ``cache`` is unchanged.

    Layers are copied shallowly: reordering and the next forward pass replace their tensors
    rather than writing into them."""
    chunk = copy.copy(cache)
    chunk.layers = [copy.copy(layer) for layer in cache.layers]
    chunk.reorder_cache(rows)
    return chunk


# Positions whose log-softmax is taken at once: a few MB of float32 at any vocabulary, so the
# log-probabilities stay in cache between the softmax and the reads of targets and argmax.
SOFTMAX_CHUNK_BYTES = 4 << 20


def continuation_scores(logits: torch.Tensor, starts: list[int], continuations: list[list[int]],
                        dtype: torch.dtype | None = None) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) of each row's continuation, as HFLM computes them.

    Row ``r``'s continuation token ``j`` is scored by ``logits[r, starts[r] + j]``. Only those
    positions go through the log-softmax (in ``dtype``, HFLM's ``softmax_dtype``), a few at a time;
    a continuation's log-probabilities are summed in that dtype, as HFLM sums them."""
    rows = torch.tensor([row for row, tokens in enumerate(continuations) for _ in tokens], device=logits.device)
    positions = torch.tensor([start + j for start, tokens in zip(starts, continuations, strict=True)
                              for j in range(len(tokens))], device=logits.device)
    targets = torch.tensor([token for tokens in continuations for token in tokens], device=logits.device)
    out_dtype = dtype or logits.dtype
    picked = torch.empty(len(targets), dtype=out_dtype, device=logits.device)
    greedy = torch.empty(len(targets), dtype=torch.bool, device=logits.device)
    step = max(1, SOFTMAX_CHUNK_BYTES // (logits.shape[-1] * torch.finfo(out_dtype).bits // 8))
    for begin in range(0, len(targets), step):
        end = min(begin + step, len(targets))
        log_probs = F.log_softmax(logits[rows[begin:end], positions[begin:end]], dim=-1, dtype=dtype)
        wanted = targets[begin:end]
        picked[begin:end] = log_probs.gather(1, wanted.unsqueeze(-1)).squeeze(-1)
        greedy[begin:end] = log_probs.argmax(dim=-1) == wanted
    answers, begin = [], 0
    for tokens in continuations:
        end = begin + len(tokens)
        answers.append((float(picked[begin:end].sum()), bool(greedy[begin:end].all())))
        begin = end
    return answers


def _forward_parameters(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


class SharedContextHFLM(HFLM):
    """HFLM scoring requests that share a context from one cached pass over that context."""

    def __init__(self, *args, share_contexts: bool = True, encodings: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.share_contexts = share_contexts
        # string, options -> token ids: each choice re-encodes its context, and the models of one
        # comparison encode the same strings (``encodings`` is shared when their tokenizers agree).
        self.encodings: dict = {} if encodings is None else encodings

    def tokenizer_fingerprint(self) -> str | None:
        """What the encoding of a string depends on; None when it cannot be stated (slow tokenizers)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        state = [type(self.tokenizer).__name__, backend.to_str(), self.add_bos_token, self.prefix_token_id]
        return hashlib.sha256(json.dumps(state, default=str).encode()).hexdigest()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        if kwargs:
            return super().tok_encode(string, add_special_tokens, left_truncate_len, **kwargs)
        key = (string, add_special_tokens, left_truncate_len)
        encoding = self.encodings.get(key)
        if encoding is None:
            encoding = self.encodings[key] = tuple(super().tok_encode(string, add_special_tokens, left_truncate_len))
        return list(encoding)

    def shares_contexts(self) -> bool:
        """Whether this model's requests can take the shared-context path at all."""
        if not self.share_contexts or self.backend != "causal" or not isinstance(self.batch_size, int):
            return False
        architecture = ARCHITECTURES.get(getattr(self.model.config, "model_type", None))
        if architecture is None or not architecture.shared_context:
            return False
        parameters = _forward_parameters(self.model)
        return "logits_to_keep" in parameters and bool({"cache", "past_key_values"} & parameters)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if not self.shares_contexts():
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        shared, lone, plain = group_requests(requests, self.max_length)
        if not shared and not lone:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        if plain:
            answers = super()._loglikelihood_tokens(
                [requests[i] for i in plain], disable_tqdm=True, override_bs=override_bs)
            for index, answer in zip(plain, answers, strict=True):
                results[index] = answer
        # Per forward pass, as many tokens as HFLM's batch of full-length rows; suffixes are short,
        # so twice the batch size of them per pass.
        batch_size = override_bs or self.batch_size
        budget = batch_size * self.max_length
        progress = tqdm(total=len(requests) - len(plain), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests (shared contexts)")
        scored = itertools.chain((self._score_groups(batch, 2 * batch_size)
                                  for batch in batches(shared, budget, self.max_length)),
                                 (self._score_lone(batch) for batch in lone_batches(lone, budget)))
        for answers in scored:
            for index, answer in answers:
                results[index] = answer
                request_strings = requests[index][0]
                if request_strings is not None:
                    self.cache_hook.add_partial("loglikelihood", request_strings, answer)
                progress.update(1)
        progress.close()
        return results

    def _call(self, **inputs) -> object:
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            return self.model(**inputs)

    def _left_padded(self, rows: list[list[int]], use_cache: bool, logits_to_keep: int) -> tuple[object, torch.Tensor]:
        """Left-padded ``rows`` through the model, the head on the last ``logits_to_keep``
        positions; returns (the model's output, the attention mask)."""
        width = max(len(row) for row in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            ids[index, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[index, width - len(row):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": use_cache, "logits_to_keep": logits_to_keep}
        if "position_ids" in _forward_parameters(self.model):
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        return self._call(**inputs), mask

    def _run_prefixes(self, batch: list[ContextGroup]):
        """Left-padded prefixes through the model with a cache; returns (cache, mask, lengths)."""
        output, mask = self._left_padded([group.prefix for group in batch], use_cache=True, logits_to_keep=1)
        cache = getattr(output, "cache", None) or output.past_key_values
        lengths = torch.tensor([len(group.prefix) for group in batch], dtype=torch.long, device=self.device)
        return cache, mask, lengths

    def _score_lone(self, batch: list[ContextGroup]) -> list[tuple[int, tuple[float, bool]]]:
        """Requests alone with their context, each row ``(context + continuation)[:-1]`` in one
        pass; rows end together (left padding), so the head runs on the last ``longest
        continuation`` positions."""
        continuations = [group.continuations[0] for group in batch]
        keep = max(len(tokens) for tokens in continuations)
        output, _ = self._left_padded([group.prefix + group.suffixes[0] for group in batch], use_cache=False,
                                      logits_to_keep=keep)
        scores = continuation_scores(output.logits, [keep - len(tokens) for tokens in continuations],
                                     continuations, self.softmax_dtype)
        return [(group.indices[0], score) for group, score in zip(batch, scores, strict=True)]

    def _score_groups(self, batch: list[ContextGroup], rows_per_chunk: int) -> list[tuple[int, tuple[float, bool]]]:
        """Every request of ``batch``: (its index, (loglikelihood, is_greedy)), as HFLM computes them."""
        cache, prefix_mask, lengths = self._run_prefixes(batch)
        requests = [(g, index, suffix, continuation) for g, group in enumerate(batch)
                    for index, suffix, continuation in zip(group.indices, group.suffixes, group.continuations,
                                                           strict=True)]
        answers = []
        for chunk in suffix_chunks([len(request[2]) for request in requests], rows_per_chunk):
            selected = [requests[row] for row in chunk]
            rows = torch.tensor([request[0] for request in selected], device=self.device)
            logits = self._run_suffixes(_repeated_cache(cache, rows), prefix_mask[rows], lengths[rows],
                                        [request[2] for request in selected])
            continuations = [request[3] for request in selected]
            scores = continuation_scores(logits, [0] * len(selected), continuations, self.softmax_dtype)
            answers += [(request[1], score) for request, score in zip(selected, scores, strict=True)]
        return answers

    def _run_suffixes(self, cache, prefix_mask: torch.Tensor, lengths: torch.Tensor,
                      suffixes: list[list[int]]) -> torch.Tensor:
        """Logits at every suffix position, each row on its prefix's cache."""
        width = max(len(suffix) for suffix in suffixes)
        ids = torch.zeros((len(suffixes), width), dtype=torch.long)
        # Padding after a suffix repeats its last position: never attended, and never out of range.
        offsets = torch.zeros((len(suffixes), width), dtype=torch.long)
        for row, suffix in enumerate(suffixes):
            ids[row, :len(suffix)] = torch.tensor(suffix, dtype=torch.long)
            offsets[row] = torch.arange(width).clamp(max=len(suffix) - 1)
        ids, offsets = ids.to(self.device), offsets.to(self.device)
        inputs = {"input_ids": ids, "attention_mask": torch.cat([prefix_mask, torch.ones_like(ids)], dim=1),
                  "use_cache": True}
        parameters = _forward_parameters(self.model)
        inputs["cache" if "cache" in parameters else "past_key_values"] = cache
        if "position_ids" in parameters:
            inputs["position_ids"] = lengths.unsqueeze(1) + offsets
        return self._call(**inputs).logits
