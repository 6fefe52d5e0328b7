"""Residual adds fused into norms in every causal family: patched models equal the unpatched
converted model, and a changed upstream block body leaves that block unfused but correct."""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch
import transformers
from helpers import make_hard

import normswap
from normswap.kernels import fusion
from normswap.kernels.patch import patch, unpatch

SMALL = {"vocab_size": 61, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
NEOX = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 32}  # fmt: skip
FALCON = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
# one case per block structure (sequential, parallel, the Falcon variants)
CASES = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, **SMALL),
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(n_layer=2, n_embd=32, n_head=4, n_positions=32,
                                                         multi_query=True, **SMALL),
    "gpt_neo": lambda: transformers.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, intermediate_size=64,
                                                 max_position_embeddings=32,
                                                 attention_types=[[["global", "local"], 1]], window_size=4, **SMALL),
    "gptj": lambda: transformers.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=32, **SMALL),
    "codegen": lambda: transformers.CodeGenConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=32,
                                                  **SMALL),
    "gpt_neox-parallel": lambda: transformers.GPTNeoXConfig(**NEOX, use_parallel_residual=True, **SMALL),
    "gpt_neox-sequential": lambda: transformers.GPTNeoXConfig(**NEOX, use_parallel_residual=False, **SMALL),
    "opt": lambda: transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                          max_position_embeddings=32, word_embed_proj_dim=32, **SMALL),
    "phi": lambda: transformers.PhiConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=32,
                                          partial_rotary_factor=0.5, **SMALL),
    "falcon-two-norms": lambda: transformers.FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2,
                                                          **SMALL),
    "falcon-parallel": lambda: transformers.FalconConfig(**FALCON, new_decoder_architecture=False, parallel_attn=True,
                                                         multi_query=True, **SMALL),
    "falcon-sequential": lambda: transformers.FalconConfig(**FALCON, new_decoder_architecture=False,
                                                           parallel_attn=False, multi_query=False, alibi=True,
                                                           **SMALL),
}  # fmt: skip


def converted(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    original = make_hard(transformers.AutoModelForCausalLM.from_config(CASES[case]()).eval())
    return normswap.convert_model(original)


def ids(length: int = 7) -> torch.Tensor:
    return torch.randint(2, 61, (2, length), generator=torch.Generator().manual_seed(1))


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    stack = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    return list(stack)


def run(model, tokens, cache=None):
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=tokens, use_cache=True, **({name: cache} if cache is not None else {}))
    return out.logits, getattr(out, "cache", None) or out.past_key_values


@pytest.mark.parametrize("case", CASES)
def test_every_family_is_fused_and_exact(case, monkeypatch):
    model = converted(case)
    fused = patch(copy.deepcopy(model))
    assert all("forward" in b.__dict__ and fusion._NEXT in b.__dict__ for b in blocks(fused)), case
    handoffs = []
    take = fusion.take_pending
    monkeypatch.setattr(fusion, "take_pending", lambda norm, x: handoffs.append(t := take(norm, x)) or t)
    with torch.no_grad():
        want, want_cache = run(model, ids())
        got, got_cache = run(fused, ids())
        assert torch.equal(got, want)
        step = ids(1)
        assert torch.equal(run(fused, step, got_cache)[0], run(model, step, want_cache)[0])
    # every block's last add was handed to the norm after it, in both forwards
    assert sum(t is not None for t in handoffs) == 2 * len(blocks(fused)), case


def test_bloom_blocks_stay_unfused():
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **SMALL)
    torch.manual_seed(0)
    model = normswap.convert_model(make_hard(transformers.AutoModelForCausalLM.from_config(config).eval()))
    fused = patch(copy.deepcopy(model))
    assert not any("forward" in b.__dict__ for b in blocks(fused))
    with torch.no_grad():
        assert torch.equal(run(fused, ids())[0], run(model, ids())[0])


@pytest.mark.parametrize("case", ["gpt2", "gptj", "gpt_neox-sequential", "falcon-sequential"])
def test_changed_upstream_body_is_left_unfused(case, monkeypatch):
    model = converted(case)
    cls = type(blocks(model)[0])
    stock = cls.forward

    def changed(self, *args, **kwargs):  # another body: the fingerprint no longer matches
        return stock(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", changed)
    fusion.upstream_class.cache_clear()
    try:
        fused = patch(copy.deepcopy(model))
        assert not any("forward" in b.__dict__ or fusion._NEXT in b.__dict__ for b in blocks(fused))
        with torch.no_grad():
            assert torch.equal(run(fused, ids())[0], run(model, ids())[0])
    finally:
        monkeypatch.undo()
        fusion.upstream_class.cache_clear()


def test_installed_bodies_are_the_fingerprinted_ones():
    # fails when a transformers release changes a block forward: re-read the fused forward
    # against the new body, then add the new fingerprint
    missing = {f.family for f in fusion.FUSIONS} - {f.family for f in fusion.FUSIONS if fusion.upstream_class(f)}
    assert not missing


def test_handoff_is_refused_for_a_modified_tensor():
    model = patch(converted("gpt2"))
    block, norm = model.transformer.h[0], model.transformer.h[1].ln_1
    x, r = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    with torch.no_grad():
        s = fusion.end_add(block, x, r)
        assert fusion._PENDING in norm.__dict__
        s.mul_(2)  # in place between the block and the norm: the version counter moves on
        assert torch.equal(norm(s), normswap.kernels.rms_norm(s, norm.weight, norm.bias, norm.eps))
        assert fusion._PENDING not in norm.__dict__
        other = fusion.end_add(block, x, r)
        assert torch.equal(norm(other.clone()), norm(other))  # another tensor: computed afresh


def test_hooked_block_output_is_not_handed_off():
    model = converted("gpt2")
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.transformer.h[0].register_forward_hook(lambda mod, args, out: out.mul_(0.5))
    patch(model)
    with torch.no_grad():
        assert torch.equal(run(model, ids())[0], run(reference, ids())[0])


def test_unpatch_removes_handoffs():
    model = patch(converted("phi"))
    with torch.no_grad():
        run(model, ids())
    unpatch(model)
    assert not any(fusion._NEXT in m.__dict__ or fusion._PENDING in m.__dict__ or "forward" in m.__dict__
                   for m in model.modules())  # fmt: skip


# the kernels themselves: compiled on CUDA (quick), interpreted on CPU (slow)
_SLOW_ON_CPU = pytest.mark.slow if not torch.cuda.is_available() else (lambda test: test)


@_SLOW_ON_CPU
@pytest.mark.parametrize("case", ["gpt2", "gptj", "falcon-sequential"])
def test_fused_families_through_the_kernels(case):
    from normswap.kernels.testing import interpreter_env, interpreter_unavailable

    cuda = torch.cuda.is_available()
    reason = None if cuda else interpreter_unavailable()
    if reason:
        pytest.skip(reason)
    model = converted(case).to("cuda" if cuda else "cpu")
    fused = patch(copy.deepcopy(model))
    tokens = ids(5).to(next(model.parameters()).device)
    with interpreter_env() if not cuda else contextlib.nullcontext(), torch.no_grad():
        got = run(fused, tokens)[0]
    with torch.no_grad():
        want = run(model, tokens)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["gpt2", "gpt_neox-parallel"])
def test_patched_blocks_compile_fullgraph(case):
    model = patch(converted(case))
    block = blocks(model)[0]
    x = torch.randn(2, 5, 32)
    kwargs = {"position_embeddings": model.gpt_neox.rotary_emb(x, torch.arange(5)[None])} if "neox" in case else {}
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(x, **kwargs)
        assert not any(fusion._PENDING in m.__dict__ for m in model.modules())  # no handoff inside a graph
        want = block(x, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_compile_for_generation_generates_what_eager_does():
    model = normswap.kernels.patch(converted("gpt2"))
    prompt = ids(4)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    torch._dynamo.reset()
    normswap.kernels.compile_for_generation(model, mode=None, backend="eager")
    try:
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    finally:
        del model.forward
        torch._dynamo.reset()
    assert torch.equal(got, want)
