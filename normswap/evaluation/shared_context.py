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

Anything not handled exactly like lm-eval goes to HFLM's own path, per request: contexts of one
token (nothing to share: rolling windows), requests left-truncated to ``max_length``, encoder-
decoder models, families whose adapter does not declare ``shared_context``, ``batch_size="auto"``, and runs with
``share_contexts=False``.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
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


def group_requests(requests: list[Request], max_length: int) -> tuple[list[ContextGroup], list[int]]:
    """Context groups (longest prefix first) and the indices of requests left to HFLM's own path."""
    groups: dict[tuple[int, ...], ContextGroup] = {}
    plain: list[int] = []
    for index, (_, context, continuation) in enumerate(requests):
        if len(context) < 2 or not continuation or len(context) + len(continuation) > max_length + 1:
            plain.append(index)
            continue
        key = tuple(context)
        group = groups.get(key)
        if group is None:
            group = groups[key] = ContextGroup(prefix=list(context[:-1]))
        group.indices.append(index)
        group.suffixes.append([context[-1], *continuation[:-1]])
        group.continuations.append(list(continuation))
    ordered = sorted(groups.values(), key=lambda g: (-len(g.prefix), g.prefix))
    return ordered, plain


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
        groups, plain = group_requests(requests, self.max_length)
        if not groups:
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
        progress = tqdm(total=len(requests) - len(plain), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests (shared contexts)")
        for batch in batches(groups, batch_size * self.max_length, self.max_length):
            for index, answer in self._score_groups(batch, 2 * batch_size):
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

    def _run_prefixes(self, batch: list[ContextGroup]):
        """Left-padded prefixes through the model with a cache; returns (cache, mask, lengths)."""
        width = max(len(group.prefix) for group in batch)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        ids = torch.full((len(batch), width), int(pad), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, group in enumerate(batch):
            ids[row, width - len(group.prefix):] = torch.tensor(group.prefix, dtype=torch.long)
            mask[row, width - len(group.prefix):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": True, "logits_to_keep": 1}
        if "position_ids" in _forward_parameters(self.model):
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        output = self._call(**inputs)
        cache = getattr(output, "cache", None) or output.past_key_values
        lengths = torch.tensor([len(group.prefix) for group in batch], dtype=torch.long, device=self.device)
        return cache, mask, lengths

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
            log_probs = self._run_suffixes(_repeated_cache(cache, rows), prefix_mask[rows], lengths[rows],
                                           [request[2] for request in selected])
            for row, (_, index, _, continuation) in enumerate(selected):
                tokens = torch.tensor(continuation, dtype=torch.long, device=self.device)
                scored = log_probs[row, :len(continuation)]
                greedy = bool((scored.argmax(dim=-1) == tokens).all())
                value = float(torch.gather(scored, 1, tokens.unsqueeze(-1)).sum())
                answers.append((index, (value, greedy)))
        return answers

    def _run_suffixes(self, cache, prefix_mask: torch.Tensor, lengths: torch.Tensor,
                      suffixes: list[list[int]]) -> torch.Tensor:
        """Log-probabilities at every suffix position, each row on its prefix's cache."""
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
        return F.log_softmax(self._call(**inputs).logits, dim=-1, dtype=self.softmax_dtype)
