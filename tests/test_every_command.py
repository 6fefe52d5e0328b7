"""Every command on every supported family, with the input that family reads.

For a tiny model of each family: ``convert`` (plain and ``--fold-gains``), ``inspect``, ``verify``,
``eval`` (converted against original) and ``geometry`` (original and converted side by side) run
through the command line and succeed; text models read a short text through the bundled
tokenizer, Whisper the bundled speech, ViT, CLIP, DeiT, DINOv2 and BEiT the bundled images; the
text encoder-decoders run geometry on text and are refused by eval in one line. Nothing tracebacks.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from helpers import make_hard
from media_models import tiny_clip, tiny_image_model, tiny_vit, tiny_whisper

from normswap.architectures import ARCHITECTURES
from normswap.checkpoint.source import example_model_path
from normswap.cli import main

SMALL = dict(vocab_size=2048, bos_token_id=0, eos_token_id=0, pad_token_id=1)
LLAMA_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, **SMALL)
TEXT_FAMILIES = {
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **SMALL)),
    "gpt_neo": lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(
        num_layers=2, hidden_size=32, num_heads=4, intermediate_size=64, max_position_embeddings=64,
        attention_types=[[["global", "local"], 1]], window_size=4, **SMALL)),
    "gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=64,
                                                   **SMALL)),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
        **SMALL)),
    "opt": lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32,
                                                **SMALL)),
    "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, seq_length=64, **SMALL)),
    "phi": lambda: T.PhiForCausalLM(T.PhiConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=64, max_position_embeddings=64,
                                                partial_rotary_factor=0.5, **SMALL)),
    "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                         new_decoder_architecture=True, num_kv_heads=2,
                                                         max_position_embeddings=64, **SMALL)),
    "gpt_bigcode": lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(n_layer=2, n_embd=32, n_head=4,
                                                                      n_positions=64, **SMALL)),
    "codegen": lambda: T.CodeGenForCausalLM(T.CodeGenConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4,
                                                            n_positions=64, **SMALL)),
    "ctrl": lambda: T.CTRLLMHeadModel(T.CTRLConfig(n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=64,
                                                   vocab_size=2048)),
    "xglm": lambda: T.XGLMForCausalLM(T.XGLMConfig(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                                                   max_position_embeddings=64, **SMALL)),
    "biogpt": lambda: T.BioGptForCausalLM(T.BioGptConfig(**LLAMA_LIKE)),
    "starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**LLAMA_LIKE, num_key_value_heads=2)),
    "stablelm": lambda: T.StableLmForCausalLM(T.StableLmConfig(**LLAMA_LIKE, num_key_value_heads=2, qk_layernorm=True)),
    "persimmon": lambda: T.PersimmonForCausalLM(T.PersimmonConfig(**LLAMA_LIKE, qk_layernorm=True)),
    "mpt": lambda: T.MptForCausalLM(T.MptConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=64, vocab_size=2048)),
    "olmo": lambda: T.OlmoForCausalLM(T.OlmoConfig(**LLAMA_LIKE)),
    "cohere": lambda: T.CohereForCausalLM(T.CohereConfig(**LLAMA_LIKE, num_key_value_heads=2, use_qk_norm=True)),
    "nemotron": lambda: T.NemotronForCausalLM(T.NemotronConfig(**LLAMA_LIKE, num_key_value_heads=2, head_dim=8)),
}
_BART_LIKE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, decoder_start_token_id=2, **SMALL)
# text encoder-decoders: geometry reads text (the same text on both sides); eval's text scores are
# a causal LM's (perplexity, lm-eval log-likelihoods of a continuation), which they have no form of
SEQ2SEQ = {
    "m2m_100": lambda: T.M2M100ForConditionalGeneration(T.M2M100Config(**_BART_LIKE)),
    "mbart": lambda: T.MBartForConditionalGeneration(T.MBartConfig(**_BART_LIKE)),
    "pegasus": lambda: T.PegasusForConditionalGeneration(T.PegasusConfig(**_BART_LIKE)),
    "blenderbot": lambda: T.BlenderbotForConditionalGeneration(T.BlenderbotConfig(**_BART_LIKE)),
}
_VIT_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8)


def _image_model(model_class, config):
    return lambda path: (tiny_image_model(path, model_class, config()), "--images")


MEDIA_FAMILIES = {
    "whisper": lambda path: (tiny_whisper(path), "--audio"),
    "vit": lambda path: (tiny_vit(path), "--images"),
    "clip": lambda path: (tiny_clip(path), "--images"),
    "deit": _image_model(T.DeiTForImageClassification, lambda: T.DeiTConfig(**_VIT_LIKE, intermediate_size=37)),
    "dinov2": _image_model(T.Dinov2Model, lambda: T.Dinov2Config(**_VIT_LIKE, layerscale_value=0.3)),
    "beit": _image_model(T.BeitForImageClassification, lambda: T.BeitConfig(**_VIT_LIKE, intermediate_size=37,
                                                                            layer_scale_init_value=0.3)),
}
FAMILIES = sorted({*TEXT_FAMILIES, *MEDIA_FAMILIES, *SEQ2SEQ})


def test_every_supported_family_is_covered():
    assert {a.model_types[0] for a in ARCHITECTURES.values()} <= set(FAMILIES)


@pytest.fixture(scope="module")
def short_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "short.txt"
    excerpt = (example_model_path().parent / "text" / "persuasion-excerpt.txt").read_text(encoding="utf-8")
    path.write_text(excerpt[20_000:22_000], encoding="utf-8")
    return path


def build(family: str, path):
    if family in MEDIA_FAMILIES:
        return MEDIA_FAMILIES[family](path)
    torch.manual_seed(0)
    make_hard({**TEXT_FAMILIES, **SEQ2SEQ}[family]()).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((example_model_path() / name).read_bytes())
    return path, None


# GPT-2 is in the quick loop (-m "not slow"); the other families are slow.
QUICK = {"gpt2"}


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_every_command(family, tmp_path, short_text, capsys):
    src, option = build(family, tmp_path / family)
    plain, folded = tmp_path / "plain", tmp_path / "folded"

    def ok(*args: str) -> str:
        code = main(list(args))
        captured = capsys.readouterr()
        assert code == 0, f"{' '.join(args[:1])}: {captured.err[-1500:]}"
        assert "Traceback" not in captured.err
        return captured.out

    # the plain conversion feeds geometry's comparison; the folded one is verified, twice
    ok("convert", str(src), "--out", str(plain), "--quiet", "--verify", "none")
    ok("convert", str(src), "--out", str(folded), "--fold-gains", "--quiet")
    assert "norm" in ok("inspect", str(src)).lower()
    ok("verify", str(src), str(folded))
    if option is not None:
        inputs = [option, "bundled"]
        geometry_inputs = inputs
    else:
        inputs = ["--text", str(short_text), "--max-length", "32", "--batch-size", "4"]
        geometry_inputs = ["--text", str(short_text), "--max-tokens", "128", "--seq-len", "32"]
    if family in SEQ2SEQ:
        assert main(["eval", str(folded), "--baseline", str(src), "--device", "cpu", *inputs]) != 0
        error = capsys.readouterr().err
        assert "encoder-decoder" in error and "Traceback" not in error and len(error.strip().splitlines()) == 1
    else:
        report = ok("eval", str(folded), "--baseline", str(src), "--device", "cpu", "--no-progress", *inputs)
        assert "## Comparison: PASS" in report
    geometry = ok("geometry", str(src), "--compare", str(plain), *geometry_inputs)
    assert "mean share" in geometry and "NOT orthogonal" not in geometry
