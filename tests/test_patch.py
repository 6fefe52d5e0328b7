"""normswap.kernels.patch: the patched model computes what the unpatched RMSNorm model computes."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from normswap.kernels.ops import fallback
from normswap.kernels.patch import is_rmsnorm, patch, unpatch
from normswap.kernels.testing import interpreter_env, interpreter_unavailable
from normswap.modeling import remote


def tiny_gpt2(*, seed: int = 0, swap=remote.swap_layer_norms) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with random norm parameters, converted to RMSNorm form, in eval mode."""
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=50)
    model = GPT2LMHeadModel(config)
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            with torch.no_grad():
                module.weight.normal_(1.0, 0.3)
                module.bias.normal_(0.0, 0.3)
    assert swap(model) == 5
    return model.eval()


# the KV-cache keyword of this transformers version (``cache``; ``past_key_values`` before 5.18)
CACHE_KW = "cache" if "cache" in inspect.signature(GPT2LMHeadModel.forward).parameters else "past_key_values"


def past(output):
    return getattr(output, "cache", None) or output.past_key_values


def tokens(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(1))


def test_patch_replaces_norm_and_block_forwards():
    model = patch(tiny_gpt2())
    norms = [m for m in model.modules() if is_rmsnorm(m)]
    assert len(norms) == 5 and all("forward" in m.__dict__ for m in norms)
    assert all("forward" in block.__dict__ for block in model.transformer.h)
    assert patch(model) is model  # idempotent
    unpatch(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_patched_model_is_bitwise_identical_on_cpu():
    model = tiny_gpt2()
    patched = patch(copy.deepcopy(model))
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, model(ids).logits)


def test_patched_model_with_cache_and_mask():
    model = tiny_gpt2()
    patched = patch(copy.deepcopy(model))
    ids = tokens(length=6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        out = [m(ids, attention_mask=mask, use_cache=True) for m in (model, patched)]
        assert torch.equal(out[0].logits, out[1].logits)
        step = tokens(length=1)
        mask = torch.cat([mask, torch.ones_like(step)], 1)
        nxt = [m(step, attention_mask=mask, **{CACHE_KW: past(o)}) for m, o in zip((model, patched), out, strict=True)]
        assert torch.equal(nxt[0].logits, nxt[1].logits)
        # the cache was used: the step's logits differ from the step run without the prompt
        assert not torch.allclose(nxt[0].logits, model(step).logits)


def test_patched_model_gradients_match():
    model = tiny_gpt2().train()
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    patched = patch(copy.deepcopy(model))
    ids = tokens()
    for m in (model, patched):
        m(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), patched.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_remote_code_copies_are_duck_typed(tmp_path):
    # a checkpoint's modeling_normswap.py is a separate module: its RMSNorm is another class
    spec = importlib.util.spec_from_file_location("modeling_normswap_copy", remote.__file__)
    copy_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy_module)
    model = tiny_gpt2(swap=copy_module.swap_layer_norms)
    assert type(model.transformer.ln_f) is not remote.RMSNorm
    reference = copy.deepcopy(model)
    patch(model)
    assert "forward" in model.transformer.ln_f.__dict__
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, reference(tokens()).logits)


def test_hooked_norms_are_not_bypassed():
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    calls = []
    for m in (model, reference):
        m.transformer.h[0].ln_2.register_forward_hook(lambda mod, args, out: calls.append(1) or out * 2)
    patch(model)
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, reference(tokens()).logits)
    assert len(calls) == 2


def test_overridden_block_forward_is_left_alone():
    model = tiny_gpt2()
    block = model.transformer.h[0]
    block.__class__ = types.new_class("MyBlock", (type(block),), {}, lambda ns: ns.update(forward=type(block).forward))
    patch(model)
    assert "forward" not in block.__dict__
    assert "forward" in model.transformer.h[1].__dict__


def test_patched_model_under_the_interpreter():
    reason = interpreter_unavailable() if not torch.cuda.is_available() else "CUDA: see test_kernels"
    if reason:
        pytest.skip(reason)
    model = tiny_gpt2()
    patched = patch(copy.deepcopy(model))
    ids = tokens(length=5)
    with interpreter_env(), torch.no_grad():
        got = patched(ids).logits
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_patched_model_compiles_without_graph_breaks():
    model = patch(tiny_gpt2())
    compiled = torch.compile(model.transformer.h[0], fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model.transformer.h[0](x))


@pytest.mark.parametrize("shape", [(1, 768), (3, 768), (300, 768), (2049, 2048)])  # each fallback branch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fallback_is_bitwise_the_modeling_forward(shape, dtype):
    norm = remote.RMSNorm(shape[-1], eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(*shape).to(dtype)
    with torch.no_grad():
        assert torch.equal(fallback.rms_norm_torch(x, norm.weight, norm.bias, norm.eps), norm(x))
        y, s = fallback.add_rms_norm_torch(x, x.flip(0), norm.weight, norm.bias, norm.eps)
        assert torch.equal(s, x + x.flip(0)) and torch.equal(y, norm(x + x.flip(0)))


@pytest.mark.parametrize("eps, error", [(float("nan"), ValueError), (-1.0, ValueError), ("1e-5", TypeError)])
def test_patched_norm_with_bad_eps_raises_the_door_error(eps, error):
    """A patched norm's quick argument check sends what it does not pass through rms_norm's own checks."""
    model = patch(tiny_gpt2())
    norm = model.transformer.ln_f
    x = torch.randn(2, 32)
    assert torch.equal(norm(x), fallback.rms_norm_torch(x, norm.weight, norm.bias, norm.eps))
    norm.eps = eps
    with pytest.raises(error, match="eps"):
        norm(x)
