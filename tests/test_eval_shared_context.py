"""The shared-context lm-eval model scores exactly as lm-eval's own HFLM path, family by family."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import transformers as T

pytest.importorskip("lm_eval")

from lm_eval.models.huggingface import HFLM  # noqa: E402

from normswap.architectures import ARCHITECTURES  # noqa: E402
from normswap.checkpoint.source import example_model_path  # noqa: E402
from normswap.evaluation import shared_context  # noqa: E402
from normswap.evaluation.shared_context import SharedContextHFLM, group_requests  # noqa: E402

VOCAB = 2048
POSITIONS = 64


def tiny_causal(family: str) -> torch.nn.Module:
    """A tiny random causal LM of ``family`` (vocabulary 2048, 64 positions)."""
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4)
    builders = {
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=POSITIONS, **common)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            intermediate_size=37, max_position_embeddings=POSITIONS, **small, **common)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(
            ffn_dim=37, word_embed_proj_dim=32, max_position_embeddings=POSITIONS, pad_token_id=1, **small, **common)),
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(n_layer=2, hidden_size=32, n_head=4, **common)),
        "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, alibi=False,
            max_position_embeddings=POSITIONS, **common)),
        "gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(
            n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=POSITIONS, **common)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(
            intermediate_size=37, max_position_embeddings=POSITIONS, **small, **common)),
        "gpt_neo": lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(
            num_layers=2, hidden_size=32, num_heads=4, attention_types=[[["global", "local"], 1]],
            window_size=8, max_position_embeddings=POSITIONS, **common)),
        "gpt_bigcode": lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
            n_layer=2, n_embd=32, n_head=4, n_positions=POSITIONS, **common)),
        "codegen": lambda: T.CodeGenForCausalLM(T.CodeGenConfig(
            n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=POSITIONS, n_ctx=POSITIONS, **common)),
    }
    torch.manual_seed(0)
    return builders[family]().eval()


@pytest.fixture(scope="module")
def tokenizer():
    path = example_model_path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the bundled tokenizer is missing")
    return T.AutoTokenizer.from_pretrained(path)


def random_requests(seed: int = 0, *, max_length: int = POSITIONS) -> list:
    """Multiple-choice groups of varied lengths, single requests, one-token contexts, and requests
    longer than ``max_length`` (left-truncated by lm-eval), shuffled together."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1, VOCAB) for _ in range(n)]  # noqa: E731
    requests = []
    for _ in range(9):
        context = tokens(rng.randrange(2, 40))
        for _ in range(rng.choice([1, 2, 4])):
            requests.append((None, context, tokens(rng.randrange(1, 6))))
    requests.append((None, tokens(1), tokens(20)))
    requests.append((None, tokens(max_length), tokens(3)))  # truncated from the left
    requests.append((None, tokens(max_length - 3), tokens(4)))  # exactly fits
    rng.shuffle(requests)
    return requests


def both_paths(model, tokenizer, requests, batch_size: int = 3):
    plain = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=POSITIONS)
    shared = SharedContextHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=POSITIONS)
    assert shared.shares_contexts()
    return plain._loglikelihood_tokens(requests, disable_tqdm=True), shared._loglikelihood_tokens(
        requests, disable_tqdm=True)


@pytest.mark.parametrize("family", sorted(name for name, each in ARCHITECTURES.items() if each.shared_context))
def test_every_listed_family_scores_as_hflm(family, tokenizer):
    model = tiny_causal(family)
    assert model.config.model_type == family
    requests = random_requests()
    expected, got = both_paths(model, tokenizer, requests)
    assert len(got) == len(expected)
    for (want, want_greedy), (value, greedy) in zip(expected, got, strict=True):
        assert value == pytest.approx(want, abs=1e-4, rel=1e-5)
        assert greedy == want_greedy


def test_grouping_shares_contexts_runs_lone_requests_whole_and_leaves_truncated_ones_to_hflm():
    requests = [(None, [1, 2, 3], [4]), (None, [1, 2, 3], [5, 6]), (None, [7], [8, 9]),
                (None, list(range(1, 10)), [1, 2]), (None, [7], [5]), (None, [4, 5], [6])]
    shared, lone, plain = group_requests(requests, max_length=9)
    assert plain == [3]
    assert len(shared) == 1 and shared[0].indices == [0, 1]
    assert shared[0].prefix == [1, 2]
    assert shared[0].suffixes == [[3], [3, 5]]
    # one-token contexts have no prefix to share, even when two requests have the same one
    assert [(g.indices, g.prefix + g.suffixes[0]) for g in lone] == [([2], [7, 8]), ([4], [7]), ([5], [4, 5])]


def test_continuation_scores_match_one_log_softmax_across_chunks(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11)
    continuations, starts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]], [4, 0, 2]
    reference = []
    for row, (start, tokens) in enumerate(zip(starts, continuations, strict=True)):
        log_probs = torch.log_softmax(logits[row, start:start + len(tokens)], dim=-1)
        picked = log_probs.gather(1, torch.tensor(tokens).unsqueeze(-1))
        reference.append((float(picked.sum()), bool((log_probs.argmax(-1) == torch.tensor(tokens)).all())))
    logits[1, 0, 4] = 50.0  # one greedy continuation
    reference[1] = (float(torch.log_softmax(logits[1, 0], -1)[4]), True)
    monkeypatch.setattr(shared_context, "SOFTMAX_CHUNK_BYTES", 2 * 11 * 4)  # two positions per chunk
    got = shared_context.continuation_scores(logits, starts, continuations)
    for (value, greedy), (want, want_greedy) in zip(got, reference, strict=True):
        assert value == pytest.approx(want, abs=1e-6) and greedy == want_greedy


def test_plain_path_on_request_and_for_unlisted_families(tokenizer, monkeypatch):
    model = tiny_causal("gpt2")
    off = SharedContextHFLM(pretrained=model, tokenizer=tokenizer, batch_size=2, share_contexts=False)
    assert not off.shares_contexts()
    monkeypatch.setitem(ARCHITECTURES, "gpt2", replace(ARCHITECTURES["gpt2"], shared_context=False))
    unlisted = SharedContextHFLM(pretrained=model, tokenizer=tokenizer, batch_size=2)
    assert not unlisted.shares_contexts()
    calls = []
    monkeypatch.setattr(SharedContextHFLM, "_score_groups", lambda self, batch: calls.append(batch))
    unlisted._loglikelihood_tokens([(None, [1, 2, 3], [4])], disable_tqdm=True)
    assert calls == []


def evaluate_bundled(share_contexts: bool, limit: int | None):
    from normswap.evaluation.runner import EvalSettings, Evaluator

    settings = EvalSettings(tasks=["local"], limit=limit, device="cpu", progress=False, share_contexts=share_contexts)
    evaluator = Evaluator(settings)
    try:
        return evaluator.evaluate("model", "normswap:austen-gpt2")
    finally:
        evaluator.close()


def assert_same_scores(plain, shared) -> None:
    assert set(shared.metrics) == set(plain.metrics)
    for key, value in plain.metrics.items():
        assert shared.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert set(shared.per_doc) == set(plain.per_doc)
    for task, documents in plain.per_doc.items():
        assert set(shared.per_doc[task]) == set(documents), task
        for doc, values in documents.items():
            # lm-eval sums a document's log-probabilities in float32: beyond 1e-4 nats, a long
            # document's total is only as exact as one unit in the last place (about 1e-7 relative).
            assert shared.per_doc[task][doc] == pytest.approx(values, abs=1e-4, rel=2e-7), (task, doc)


@pytest.mark.parametrize("limit", [pytest.param(12, id="twelve-docs"),
                                   pytest.param(None, id="every-doc", marks=pytest.mark.slow)])
def test_bundled_model_local_tasks_score_as_plain_lm_eval(limit):
    if not (example_model_path() / "config.json").is_file():
        pytest.skip("the bundled model is missing")
    plain = evaluate_bundled(False, limit)
    shared = evaluate_bundled(True, limit)
    assert plain.per_doc["persuasion_cloze"]
    assert_same_scores(plain, shared)


def test_encodings_are_shared_only_between_tokenizers_that_agree(tokenizer):
    from normswap.evaluation import lmeval

    encodings: dict = {}
    first = lmeval.make_lm(tiny_causal("gpt2"), tokenizer, batch_size=2, max_length=POSITIONS, encodings=encodings)
    second = lmeval.make_lm(tiny_causal("opt"), tokenizer, batch_size=2, max_length=POSITIONS, encodings=encodings)
    assert first.encodings is second.encodings and len(encodings) == 1
    assert first.tok_encode("Anne Elliot") == tokenizer.encode("Anne Elliot")
    assert ("Anne Elliot", None, None) in second.encodings
    other = T.AutoTokenizer.from_pretrained(example_model_path())
    other.add_tokens(["<extra>"])
    third = lmeval.make_lm(tiny_causal("gpt2"), other, batch_size=2, max_length=POSITIONS, encodings=encodings)
    assert third.encodings is not first.encodings and len(encodings) == 2
    plain = lmeval.make_lm(tiny_causal("gpt2"), tokenizer, batch_size=2, max_length=POSITIONS, share_contexts=False)
    assert type(plain) is HFLM


def test_tasks_built_once_score_the_same_for_every_model():
    if not (example_model_path() / "config.json").is_file():
        pytest.skip("the bundled model is missing")
    from normswap.evaluation.runner import EvalSettings, Evaluator

    evaluator = Evaluator(EvalSettings(tasks=["local"], limit=5, device="cpu", progress=False, perplexity=False))
    try:
        first = evaluator.evaluate("first", "normswap:austen-gpt2")
        tasks = evaluator._task_list()
        second = evaluator.evaluate("second", "normswap:austen-gpt2")
        assert evaluator._task_list() is tasks and not isinstance(tasks[0], str)
    finally:
        evaluator.close()
    assert first.metrics == second.metrics and first.per_doc == second.per_doc
    assert set(first.per_doc) == {"persuasion_cloze", "persuasion_lastword", "persuasion_rolling"}


@pytest.mark.parametrize("argv, shared, side_by_side", [
    ([], True, True), (["--plain-lm-eval"], False, True), (["--one-at-a-time"], True, False)])
def test_scoring_path_options(argv, shared, side_by_side):
    """--plain-lm-eval selects lm-eval's own path; --one-at-a-time scores a pair's models in turn."""
    import argparse

    from normswap.evaluation import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    settings = cli.settings_from_args(parser.parse_args(["out/model", "--device", "cpu", *argv]))
    assert settings.share_contexts is shared
    assert settings.side_by_side is side_by_side
