"""GPT-2: exactness of the conversion against a float64 reference, for every loader and option."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import causal_logits, check_exact, load, make_hard, safetensors_dtypes, save, token_ids
from transformers import GPT2Config, GPT2LMHeadModel

import normswap
from normswap.errors import NormswapError

VOCAB = 97


def tiny_gpt2(tmp_path, *, tied: bool = True, dtype: torch.dtype = torch.float32, name: str = "gpt2-src"):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    model = make_hard(GPT2LMHeadModel(config))
    return save(model.to(dtype), tmp_path / name)


@pytest.mark.parametrize(("fold_gains", "tied"), [
    pytest.param(False, True, marks=pytest.mark.slow), pytest.param(False, False, marks=pytest.mark.slow),
    pytest.param(True, True, marks=pytest.mark.slow), (True, False)], ids=["plain-tied", "plain-untied", "fold-tied", "fold-untied"])
def test_gpt2_is_exact(tmp_path, tied, fold_gains):
    src = tiny_gpt2(tmp_path, tied=tied)
    errors = check_exact(src, tmp_path, inputs=token_ids(VOCAB), fold_gains=fold_gains,
                         loaders=("stock", "remote", "normswap"))
    # float64 weights reproduce the float64 original to rounding noise
    assert max(error for (dtype, _), error in errors.items() if dtype == "float64") < 1e-9


def test_converted_config_and_files(tmp_path):
    src = tiny_gpt2(tmp_path)
    (src / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: [en]\n---\n# a source card\n")
    out = tmp_path / "rms"
    block = normswap.convert_checkpoint(src, out, fold_gains=True)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["model_type"] == "gpt2"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_normswap.NormswapGPT2LMHeadModel"
    assert config["normswap"]["verification"]["passed"] is True
    assert block["norms_folded"] == block["norms_swapped"]
    assert (out / "modeling_normswap.py").is_file()
    card = (out / "README.md").read_text()
    assert "max_abs_diff" in card and "RMSNorm" in card
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- normswap\n- rmsnorm\n"
                           f'base_model: "{src}"\nlicense: "apache-2.0"\npipeline_tag: "text-generation"\n---\n')
    assert "http" not in card  # no link to a page that may not exist
    assert "**Folded gains:** yes, 5 norms folded" in card  # words, not a Python value
    assert "import normswap" not in (out / "modeling_normswap.py").read_text()
    # the folded norms are weightless: unit gain, zero bias except the final norm's β/γ
    from safetensors.torch import load_file

    state = load_file(out / "model.safetensors")
    assert torch.equal(state["transformer.h.0.ln_1.weight"], torch.ones(32))
    assert torch.equal(state["transformer.h.0.ln_1.bias"], torch.zeros(32))
    assert torch.equal(state["transformer.ln_f.weight"], torch.ones(32))
    # every write into the stream is centred
    assert state["transformer.wte.weight"].double().mean(-1).abs().max() < 1e-6
    assert state["transformer.h.1.mlp.c_proj.weight"].double().mean(-1).abs().max() < 1e-6


@pytest.mark.slow
def test_hub_layout_without_prefix_and_bin(tmp_path):
    """Hub GPT-2 stores base-model names (h.0...) in a pickle; the output uses canonical names."""
    src = tiny_gpt2(tmp_path)
    model = GPT2LMHeadModel.from_pretrained(src)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    state = {name.removeprefix("transformer."): tensor for name, tensor in model.transformer.state_dict().items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))  # old causal-mask buffer
    torch.save(state, legacy / "pytorch_model.bin")
    (legacy / "config.json").write_text((src / "config.json").read_text())
    out = tmp_path / "rms"
    normswap.convert_checkpoint(legacy, out)
    ids = token_ids(VOCAB)
    reference = causal_logits(load(src, "original", torch.float64), ids)
    converted = causal_logits(load(out, "stock", torch.float64), ids)
    assert float((reference - converted).abs().max()) < 1e-4


def test_bf16_source(tmp_path):
    """bf16 keeps 8 mantissa bits: re-rounding the centred weights moves each by up to 2^-9
    relative, so the converted logits differ from the bf16 original's by a few 1e-2 on this
    model. The default bf16 tolerance (0.1 + 0.01·max|logit|) covers that and still catches any
    real mistake, which moves logits by O(1)."""
    src = tiny_gpt2(tmp_path, dtype=torch.bfloat16)
    block = normswap.convert_checkpoint(src, tmp_path / "rms")
    assert block["options"]["dtype"] == "bfloat16"
    figures = block["verification"]["loaders"]["stock"]
    assert figures["max_abs_diff"] < 0.1
    assert figures["top1_agreement"] > 0.95


def test_output_dtype_option(tmp_path):
    src = tiny_gpt2(tmp_path)
    normswap.convert_checkpoint(src, tmp_path / "half", dtype="float16")
    config = json.loads((tmp_path / "half" / "config.json").read_text())
    assert config["dtype"] == "float16"
    # the tensors themselves are written as float16, as the file's own header records them
    written = safetensors_dtypes(tmp_path / "half" / "model.safetensors")
    assert written and set(written.values()) == {"F16"}
    assert set(safetensors_dtypes(src / "model.safetensors").values()) == {"F32"}


def test_convert_model_in_memory():
    torch.manual_seed(0)
    model = make_hard(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32))).double().eval()
    converted = normswap.convert_model(model, fold_gains=True)
    ids = token_ids(VOCAB)
    assert float((causal_logits(model, ids) - causal_logits(converted, ids)).abs().max()) < 1e-9
    assert model.transformer.wte.weight.mean() != 0  # the original is untouched


def test_naive_method_needs_allow_inexact(tmp_path):
    src = tiny_gpt2(tmp_path)
    with pytest.raises(NormswapError, match="allow-inexact"):
        normswap.convert_checkpoint(src, tmp_path / "naive", method="naive")
    block = normswap.convert_checkpoint(src, tmp_path / "naive", method="naive", allow_inexact=True)
    config = json.loads((tmp_path / "naive" / "config.json").read_text())
    assert config["model_type"] == "normswap_gpt2"  # stock transformers must refuse it
    assert block["verification"]["loaders"]["stock"]["refused"] is True
    assert block["verification"]["loaders"]["remote_code"]["max_abs_diff"] > 1e-2
    # after `import normswap` the Auto classes know the normswap-only model type
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "naive")
    assert type(model).__name__ == "NormswapOnlyGPT2LMHeadModel"
    assert getattr(model.transformer.ln_f, "is_normswap_rmsnorm", False)


@pytest.mark.slow
def test_bundled_model_perplexity_is_unchanged(tmp_path):
    """The shipped Austen model: converted held-out perplexity equals the original's to 1e-4 (fp32)."""
    from normswap.checkpoint.source import EXAMPLE_MODEL, example_model_path
    from normswap.evaluation.perplexity import strided_perplexity
    from normswap.runtime.reference import tokenize_text

    if not (example_model_path() / "model.safetensors").is_file():
        pytest.skip("the bundled example model is not installed")
    text = (example_model_path().parent / "text" / "persuasion-excerpt.txt").read_text(encoding="utf-8")[:12000]
    out = tmp_path / "austen-rms"
    normswap.convert_checkpoint(EXAMPLE_MODEL, out, fold_gains=True)
    perplexities = []
    for path in (EXAMPLE_MODEL, out):
        model, tokenizer = normswap.load_model(path, dtype=torch.float32)
        ids = tokenize_text(tokenizer, text)
        perplexities.append(strided_perplexity(model, ids, max_length=256, stride=128, batch_size=4).token_perplexity)
    original, converted = perplexities
    assert original < 200  # a trained model, far from the 2048-token uniform guess
    assert abs(converted - original) / original < 1e-4


@pytest.mark.parametrize("text", [
    "no front matter\nlicense: mit\n", "---\nlicense: [mit, gpl]\n---\n", "---\nlicense: {a: b}\n---\n",
    "---\nlicense: mit\n", "---\n: : [\n---\n", "---\nlicense: \"mit\\nevil: 1\"\n---\n", "\xff\xfe---",
    "---\n" + "a: &a [x]\n" + "".join(f"b{i}: &b{i} [*{'a' if i == 0 else f'b{i - 1}'}, *{'a' if i == 0 else f'b{i - 1}'}]\n" for i in range(40)) + "---\n",
], ids=["no-front-matter", "list", "mapping", "unclosed", "bad-yaml", "newline", "not-utf8", "alias-bomb"])
def test_a_source_card_gives_a_license_only_when_it_states_one_plainly(tmp_path, text):
    from normswap.convert.card import source_license

    (tmp_path / "README.md").write_bytes(text.encode("utf-8", errors="surrogateescape")
                                         if text != "\xff\xfe---" else b"\xff\xfe---")
    assert source_license(tmp_path) is None
    (tmp_path / "README.md").write_text("---\r\nlicense: cc-by-nc-4.0\r\n---\r\n")
    assert source_license(tmp_path) == "cc-by-nc-4.0"
