"""Whisper, ViT and CLIP: exactness against a float64 reference, for every loader and option.

Tiny random models made hard (γ/β far from 1/0, embeddings, class tokens, positions, patch convs
and biases with a large mean) are converted with and without fold_gains, in float64 and float32,
and compared with the float64 original through the family's Auto class: stock classes, remote
code (RMSNorm modules only) and, where the RMSNorm class centres explicitly, normswap.load.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from helpers import assert_no_layer_norm, check_exact, load, make_hard, save, vision_outputs
from safetensors.torch import load_file

import normswap
from normswap.architectures import architecture_for
from normswap.errors import NormswapError

WHISPER = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8, max_source_positions=16,
               max_target_positions=32, vocab_size=60, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=3)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, image_size=16, patch_size=8)
CLIP_TEXT = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, vocab_size=50,
                 max_position_embeddings=16, projection_dim=24, bos_token_id=48, eos_token_id=49, pad_token_id=1)
CLIP_VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                   patch_size=8, projection_dim=24)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: intra-op threads only contend (on a busy 2-core box a 2-thread forward of
    these models takes ~1 s instead of ~5 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(tmp_path, model_class, config, name):
    torch.manual_seed(0)
    return save(make_hard(model_class(config)), tmp_path / name)


def generator(seed=3):
    return torch.Generator().manual_seed(seed)


def check_normswap_loader(src, out, forward, inputs, auto, tolerance=1e-4):
    """normswap.load (kernels patched in) keeps the structural centring hooks: fp32 exactness."""
    reference = forward(load(src, "original", torch.float64, auto), inputs)
    model = load(out, "normswap", torch.float32, auto)
    assert_no_layer_norm(model)
    error = float((forward(model, inputs) - reference).abs().max())
    assert error <= tolerance * max(1.0, float(reference.abs().max())), f"normswap loader: max |Δ| = {error:.3g}"


# ---------------------------------------------------------------------------------------------
# Whisper


def whisper_inputs():
    return {
        "input_features": torch.randn(2, WHISPER["num_mel_bins"], 2 * WHISPER["max_source_positions"], generator=generator()),
        "decoder_input_ids": torch.randint(0, WHISPER["vocab_size"], (2, 10), generator=generator(4)),
    }


@torch.no_grad()
def whisper_logits(model, inputs):
    return model(input_features=inputs["input_features"].to(model.dtype),
                 decoder_input_ids=inputs["decoder_input_ids"]).logits.double()


@pytest.mark.parametrize("fold_gains", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "fold"])
def test_whisper_is_exact(tmp_path, fold_gains):
    src = tiny(tmp_path, T.WhisperForConditionalGeneration, T.WhisperConfig(**WHISPER), "whisper")
    inputs = whisper_inputs()
    errors = check_exact(src, tmp_path, forward=whisper_logits, inputs=inputs, auto="AutoModelForSpeechSeq2Seq",
                         fold_gains=fold_gains)
    assert max(error for (dtype, _), error in errors.items() if dtype == "float64") < 1e-9
    check_normswap_loader(src, tmp_path / f"whisper-float32-{'fold' if fold_gains else 'plain'}", whisper_logits,
                          inputs, "AutoModelForSpeechSeq2Seq")

    out = tmp_path / f"whisper-float64-{'fold' if fold_gains else 'plain'}"
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["normswap"]["structure"] == {"centre_input": ["model.encoder.layers.0"]}
    assert config["normswap"]["untied"] == ["proj_out.weight"]
    state = load_file(out / "model.safetensors")
    assert "proj_out.weight" in state
    assert state["model.decoder.embed_tokens.weight"].mean(-1).abs().max() < 1e-12
    if fold_gains:
        # the encoder's final norm output is encoder_last_hidden_state: never folded
        assert "model.encoder.layer_norm" not in config["normswap"]["norms_folded"]
        assert not torch.equal(state["model.encoder.layer_norm.weight"], torch.ones(32))
        # k_proj has no bias; β still folds (a constant on every key cancels in softmax)
        assert torch.equal(state["model.decoder.layers.0.self_attn_layer_norm.bias"], torch.zeros(32))

    # the explicit encoder-input centring is what makes the RMSNorm class exact
    reference = whisper_logits(load(src, "original", torch.float64, "AutoModelForSpeechSeq2Seq"), inputs)
    remote = load(out, "remote", torch.float64, "AutoModelForSpeechSeq2Seq")
    remote.model.encoder.layers[0]._forward_pre_hooks.clear()
    assert (whisper_logits(remote, inputs) - reference).abs().max() > 1e-3


def test_whisper_other_classes_refused():
    config = {"model_type": "whisper", "architectures": ["WhisperForAudioClassification"]}
    with pytest.raises(NormswapError, match="WhisperForConditionalGeneration"):
        architecture_for(config)


# ---------------------------------------------------------------------------------------------
# ViT


def pixels(size=16):
    return torch.randn(2, 3, size, size, generator=generator())


@pytest.mark.parametrize(
    ("model_class", "auto", "fold_gains"),
    [pytest.param(T.ViTModel, "AutoModel", False, marks=pytest.mark.slow),
     pytest.param(T.ViTModel, "AutoModel", True, marks=pytest.mark.slow),
     (T.ViTForImageClassification, "AutoModelForImageClassification", True)],
    ids=["model-plain", "model-fold", "classifier-fold"],
)
def test_vit_is_exact(tmp_path, model_class, auto, fold_gains):
    src = tiny(tmp_path, model_class, T.ViTConfig(**VIT, num_labels=3), "vit")
    errors = check_exact(src, tmp_path, forward=vision_outputs, inputs=pixels(), auto=auto, fold_gains=fold_gains)
    assert max(error for (dtype, _), error in errors.items() if dtype == "float64") < 1e-9
    out = tmp_path / f"vit-float64-{'fold' if fold_gains else 'plain'}"
    config = json.loads((out / "config.json").read_text())
    state = load_file(out / "model.safetensors")
    prefix = "vit." if model_class is T.ViTForImageClassification else ""
    # the legacy checkpoint names were renamed as transformers renames them on load
    assert f"{prefix}layers.0.attention.q_proj.weight" in state
    assert state[f"{prefix}embeddings.cls_token"].mean(-1).abs().max() < 1e-12
    assert state[f"{prefix}embeddings.patch_embeddings.projection.weight"].mean(0).abs().max() < 1e-12
    assert auto in config["auto_map"]
    if fold_gains:
        assert (f"{prefix}layernorm" in config["normswap"]["norms_folded"]) == bool(prefix)


# ---------------------------------------------------------------------------------------------
# CLIP


def clip_ids():
    ids = torch.randint(2, 48, (2, 9), generator=generator(5))
    ids[:, -1] = CLIP_TEXT["eos_token_id"]
    return ids


@torch.no_grad()
def clip_outputs(model, inputs):
    """Everything CLIP returns that the conversion preserves exactly (see architectures/clip.py):
    logits, embeddings, pooled outputs, the text tower's (normed) last hidden state, and the
    vision tower's raw-stream last hidden state after removing each token's mean."""
    def centred(x):
        return x - x.mean(-1, keepdim=True)

    kwargs = {}
    if "input_ids" in inputs:
        kwargs["input_ids"] = inputs["input_ids"]
    if "pixel_values" in inputs:
        kwargs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    outputs = model(**kwargs)
    if model.config.model_type == "clip":
        parts = [outputs.logits_per_image, outputs.text_embeds, outputs.image_embeds,
                 outputs.text_model_output.last_hidden_state, outputs.text_model_output.pooler_output,
                 outputs.vision_model_output.pooler_output, centred(outputs.vision_model_output.last_hidden_state)]
    elif model.config.model_type == "clip_text_model":
        parts = [outputs.last_hidden_state, outputs.pooler_output]
    else:
        parts = [outputs.pooler_output, centred(outputs.last_hidden_state)]
    return torch.cat([part.double().flatten() for part in parts])


CLIP_CASES = {
    "model": (T.CLIPModel, lambda: T.CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=24),
              {"input_ids": clip_ids(), "pixel_values": pixels()}),
    "text": (T.CLIPTextModel, lambda: T.CLIPTextConfig(**CLIP_TEXT), {"input_ids": clip_ids()}),
    "vision": (T.CLIPVisionModel, lambda: T.CLIPVisionConfig(**CLIP_VISION), {"pixel_values": pixels()}),
}


@pytest.mark.parametrize(
    ("case", "fold_gains"),
    [pytest.param("model", False, marks=pytest.mark.slow), ("model", True),
     pytest.param("text", True, marks=pytest.mark.slow), pytest.param("vision", True, marks=pytest.mark.slow)],
    ids=["model-plain", "model-fold", "text-fold", "vision-fold"],
)
def test_clip_is_exact(tmp_path, case, fold_gains):
    model_class, config, inputs = CLIP_CASES[case]
    src = tiny(tmp_path, model_class, config(), f"clip-{case}")
    errors = check_exact(src, tmp_path, forward=clip_outputs, inputs=inputs, auto="AutoModel", fold_gains=fold_gains)
    assert max(error for (dtype, _), error in errors.items() if dtype == "float64") < 1e-9
    if case != "text":
        check_normswap_loader(src, tmp_path / f"clip-{case}-float32-{'fold' if fold_gains else 'plain'}",
                              clip_outputs, inputs, "AutoModel")
    out = tmp_path / f"clip-{case}-float64-{'fold' if fold_gains else 'plain'}"
    config = json.loads((out / "config.json").read_text())
    if case == "text":
        assert config["normswap"]["structure"] == {}
        return
    tower = "vision_model." if case == "model" else ""
    assert config["normswap"]["structure"] == {"centre_output": [f"{tower}pre_layrnorm"]}
    if case == "vision":
        # not exact: the vision tower's last_hidden_state is the raw stream, and converting
        # removes exactly its per-token mean
        original = load(src, "original", torch.float64, "AutoModel")(pixel_values=inputs["pixel_values"].double())
        converted = load(out, "remote", torch.float64, "AutoModel")(pixel_values=inputs["pixel_values"].double())
        before, after = original.last_hidden_state, converted.last_hidden_state
        assert (before - after).abs().max() > 1e-2
        assert (before - before.mean(-1, keepdim=True) - after).abs().max() < 1e-9


@pytest.mark.slow
def test_clip_vision_with_projection_builtin_verification(tmp_path):
    """The class in config.architectures is used (AutoModel would build CLIPVisionModel)."""
    src = tiny(tmp_path, T.CLIPVisionModelWithProjection, T.CLIPVisionConfig(**CLIP_VISION), "clip-vision-proj")
    block = normswap.convert_checkpoint(src, tmp_path / "rms", fold_gains=True)
    assert block["verification"]["passed"]
    assert block["structure"] == {"centre_output": ["vision_model.pre_layrnorm"]}


def test_clip_image_classification_refused():
    config = {"model_type": "clip", "architectures": ["CLIPForImageClassification"]}
    with pytest.raises(NormswapError, match="raw residual stream"):
        architecture_for(config)


@pytest.mark.slow
def test_clip_vision_legacy_layout(tmp_path):
    """Older CLIPVisionModel checkpoints carry a ``vision_model.`` prefix and position-id buffers;
    the plan renames keys as transformers does on load, and drops the buffers."""
    from safetensors.torch import save_file

    src = tiny(tmp_path, T.CLIPVisionModel, T.CLIPVisionConfig(**CLIP_VISION), "clip-vision")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    state = {f"vision_model.{name}": tensor for name, tensor in load_file(src / "model.safetensors").items()}
    state["vision_model.embeddings.position_ids"] = torch.arange(5)[None]
    save_file(state, legacy / "model.safetensors", metadata={"format": "pt"})
    (legacy / "config.json").write_text((src / "config.json").read_text())
    block = normswap.convert_checkpoint(legacy, tmp_path / "rms")
    assert block["verification"]["passed"]
    names = set(load_file(tmp_path / "rms" / "model.safetensors"))
    assert "pre_layrnorm.weight" in names and not any("position_ids" in name for name in names)


@pytest.mark.parametrize("case", ["whisper", "clip"])
def test_convert_model_in_memory(case):
    """normswap.convert_model applies the same structure (centring hooks) to an in-memory model."""
    torch.manual_seed(0)
    if case == "whisper":
        model = T.WhisperForConditionalGeneration(T.WhisperConfig(**WHISPER))
        forward, inputs = whisper_logits, whisper_inputs()
    else:
        model_class, config, inputs = CLIP_CASES["model"]
        model, forward = model_class(config()), clip_outputs
    model = make_hard(model).double().eval()
    converted = normswap.convert_model(model, fold_gains=True)
    assert_no_layer_norm(converted)
    assert float((forward(model, inputs) - forward(converted, inputs)).abs().max()) < 1e-9
