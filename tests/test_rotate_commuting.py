"""normswap rotate's commuting form (the default): Q·1 = 1, the stock LayerNorm kept.

Every causal family's tiny "hard" model, Whisper, ViT and CLIP are rotated with float64 weights and
loaded back with the *stock* class (no remote code), whose outputs must match the float64
original's to 1e-9 · max|output|; with float32 weights once per family with built-in
verification. Outputs that the form rotates (an encoder's last hidden state) must be exactly
((h - β) ⊘ γ)·Q, or (h ⊘ γ)·Q where β ⊘ γ stayed in the norm. The free form of the same sources is
tested in test_rotate.py (``--form free``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T
from helpers import causal_logits, load, make_hard, save, token_ids
from safetensors.torch import load_file
from test_architectures_causal import VOCAB, _family
from test_architectures_encoders import (
    CLIP_TEXT,
    CLIP_VISION,
    VIT,
    WHISPER,
    pixels,
    whisper_inputs,
    whisper_logits,
)
from test_bad_input import assert_one_line_error, run_cli
from test_rotate import BUNDLED, CALIBRATION, TOKENIZER_FILES, make_source, method_params, rotated_runs

from normswap.api import rotate_checkpoint
from normswap.modeling import hadamard
from normswap.rotate import commuting
from normswap.rotate.matrices import load_rotation

# ---------------------------------------------------------------------------------------------
# The constructions


@pytest.mark.parametrize("d", [1, 2, 12, 24, 32, 40, 768])
def test_every_construction_is_orthogonal_and_fixes_one(d):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, d, generator=generator, dtype=torch.float64) * 4 + 3  # far from centred
    moment = x.T @ x
    rotations = [commuting.hadamard_rotation(d, 5), commuting.orthogonal_rotation(d, 5)]
    if d > 1:
        rotations.append(commuting.pca_rotation(moment, {}))
    for rotation in rotations:
        q = rotation.matrix
        assert torch.allclose(q @ q.T, torch.eye(d, dtype=torch.float64), atol=1e-12), rotation.method
        assert commuting.commutes_with_centring(q), rotation.method
        if d > 1:
            # the identity the form rests on: LN(x·Q) = LN(x)·Q for an uncentred x, eps included
            ln = torch.nn.functional.layer_norm
            assert torch.allclose(ln(x @ q, (d,), eps=1e-5), ln(x, (d,), eps=1e-5) @ q, atol=1e-12), rotation.method


def test_commuting_hadamard_spreads_and_seeds_differ():
    h = commuting.normalised_hadamard(hadamard.hadamard_matrix(12))
    assert torch.equal(h[:, 0], torch.ones(12, dtype=torch.float64))
    assert torch.equal(h @ h.T, 12 * torch.eye(12, dtype=torch.float64))
    first, second = commuting.hadamard_rotation(64, 0).matrix, commuting.hadamard_rotation(64, 1).matrix
    assert float((first.T @ second).abs().max()) < 0.9  # not the same rotation up to signs
    assert float(first.abs().max()) < 0.5  # no coordinate is kept as it is


def test_pca_orders_the_complement_by_variance():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=generator, dtype=torch.float64) * torch.arange(1, 9, dtype=torch.float64)
    rotation = commuting.pca_rotation(x.T @ x, {"text": "t"})
    coordinates = (x @ rotation.matrix @ commuting.complement_basis(8))[:, 1:]
    variance = coordinates.pow(2).sum(0)
    assert bool((variance[:-1] >= variance[1:] - 1e-9).all())
    assert rotation.calibration["energy_share"]["top_1"] > 0


# ---------------------------------------------------------------------------------------------
# Causal families: stock class, no remote code


@pytest.mark.parametrize(("case", "method"), list(method_params(every_method="opt-projected", skip_family="bloom")))
def test_commuting_rotation_is_exact_in_the_stock_class(tmp_path, case, method):
    for run in rotated_runs(tmp_path, case, method, form="commuting"):
        if run.dtype == torch.float32:  # the verified run
            assert list(run.block["verification"]["loaders"]) == ["stock"]
        model = load(run.target, "stock", run.dtype)  # no trust_remote_code
        layer_norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]  # stock modules kept
        assert layer_norms and all(m.weight is None or torch.equal(m.weight, torch.ones_like(m.weight))
                                   for m in layer_norms)
        assert run.error(model) <= 1, f"{run.dtype}: max |Δ| is {run.error(model):.3g} of the tolerance"
        config = json.loads((run.target / "config.json").read_text())
        assert config["model_type"] == _family(case) and "auto_map" not in config
        # what a stock checkpoint holds, plus records under names no loader globs
        assert [p.name for p in run.target.glob("*.safetensors")] == ["model.safetensors"]
        assert not (run.target / "modeling_normswap.py").exists() and (run.target / "normswap_rotation.record").is_file()
        rotation = config["normswap"]["rotation"]
        assert rotation["form"] == "commuting" and rotation["centred"] is False and rotation["method"] == method
        assert config["normswap"]["stock_loadable"] and config["normswap"]["writers_centred"] == 0
        assert commuting.commutes_with_centring(load_rotation(run.target))


def test_folded_source_rotates_into_both_classes(tmp_path):
    """A --fold-gains conversion is centred already: its commuting rotation is exact in the stock
    class and in the RMSNorm class, and is verified through both."""
    import normswap

    src = make_source(tmp_path, "gpt_neox-parallel-untied")
    folded = tmp_path / "folded"
    normswap.convert_checkpoint(src, folded, fold_gains=True, verification="none")
    block = rotate_checkpoint(folded, tmp_path / "rotated", method="orthogonal", verification="full")
    assert block["rotation"]["centred"] is True and set(block["verification"]["loaders"]) == {"stock", "remote_code"}
    assert block["verification"]["passed"]


def test_layerwise_verification_compares_every_block_with_h_q(tmp_path, capsys):
    src = make_source(tmp_path, "gpt_neox-sequential-tied-nobias")
    out = tmp_path / "rotated"
    block = rotate_checkpoint(src, out, method="orthogonal", verification="layerwise")
    verification = block["verification"]
    assert verification["passed"] and verification["mode"] == "layerwise"
    layers = verification["loaders"]["stock"]["layers"]
    assert len(layers) == 2 and max(layer["max_abs_diff"] / layer["max_abs_reference"] for layer in layers) < 1e-5
    code, _ = run_cli(capsys, "verify", str(src), str(out), "--quiet")
    assert code == 0


def test_bloom_is_refused_with_the_reason(tmp_path, capsys):
    src = make_source(tmp_path, "bloom-baked")
    code, err = run_cli(capsys, "rotate", str(src), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "word_embeddings_layernorm", "--form free")
    assert not (tmp_path / "out").exists()
    # its folded conversion (own model type, baked norm) rotates, and keeps its own model type
    import normswap

    folded = tmp_path / "folded"
    normswap.convert_checkpoint(src, folded, fold_gains=True, verification="none")
    block = rotate_checkpoint(folded, tmp_path / "rotated", verification="full")
    assert block["verification"]["passed"] and not block["stock_loadable"]
    assert json.loads((tmp_path / "rotated" / "config.json").read_text())["model_type"] == "normswap_bloom"


@pytest.mark.parametrize("case", ["persimmon", pytest.param("stablelm-qk-norm", marks=pytest.mark.slow),
                                  pytest.param("cohere-qk-norm", marks=pytest.mark.slow)])
def test_per_head_qk_norms_rotate_in_both_forms(tmp_path, case):
    """A per-head q/k norm reads q_proj/k_proj's output, which (x·Q)·(Qᵀ·W) = x·W leaves as it is:
    the residual rotation is exact in both forms with the q/k norms' gains kept."""
    from test_architectures_more import CAUSAL, FP64_TOL, make_harder

    torch.manual_seed(0)
    src = save(make_harder(T.AutoModelForCausalLM.from_config(CAUSAL[case]())).eval(), tmp_path / "src")
    ids = token_ids(61)
    reference = causal_logits(load(src, "original", torch.float64), ids)
    for form, how in (("commuting", "stock"), ("free", "normswap")):
        out = tmp_path / form
        rotate_checkpoint(src, out, form=form, method="orthogonal", dtype=torch.float64, verification="none")
        error = float((causal_logits(load(out, how, torch.float64), ids) - reference).abs().max())
        assert error <= FP64_TOL.get(case, 1e-9) * max(1.0, float(reference.abs().max())), (form, error)
        gains = load_file(out / "model.safetensors")
        assert not any(torch.equal(t, torch.ones_like(t)) for n, t in gains.items() if "q_" in n and "norm" in n)
    block = rotate_checkpoint(src, tmp_path / "fp32", verification="full")  # float32, built-in verification
    assert block["verification"]["passed"]


# ---------------------------------------------------------------------------------------------
# Whisper, ViT, CLIP


def _tiny(tmp_path: Path, model: torch.nn.Module, name: str) -> Path:
    return save(make_hard(model).eval(), tmp_path / name)


def _rotated(tmp_path: Path, model: torch.nn.Module, name: str, method: str) -> tuple[Path, Path, dict]:
    """``model`` made hard, saved as ``name`` and rotated by ``method`` with float64 weights,
    verified in full: the source, the output and the provenance block."""
    src, out = _tiny(tmp_path, model, name), tmp_path / "rotated"
    return src, out, rotate_checkpoint(src, out, method=method, dtype=torch.float64, verification="full")


@pytest.mark.parametrize("method", ["hadamard", pytest.param("orthogonal", marks=pytest.mark.slow)])
def test_whisper_decoder_rotates_encoder_stays(tmp_path, method):
    torch.manual_seed(0)
    src, out, block = _rotated(tmp_path, T.WhisperForConditionalGeneration(T.WhisperConfig(**WHISPER)), "whisper", method)
    assert block["verification"]["passed"] and list(block["verification"]["loaders"]) == ["stock"]
    inputs = whisper_inputs()
    auto = "AutoModelForSpeechSeq2Seq"
    reference = whisper_logits(load(src, "original", torch.float64, auto), inputs)
    error = float((whisper_logits(load(out, "stock", torch.float64, auto), inputs) - reference).abs().max())
    assert error <= 1e-9 * max(1.0, float(reference.abs().max()))
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    encoder = [name for name in before if name.startswith("model.encoder.")]
    assert encoder and all(torch.equal(before[name].double(), after[name]) for name in encoder)
    assert torch.equal(after["model.decoder.layers.0.final_layer_norm.weight"], torch.ones(32, dtype=torch.float64))
    assert "encoder" in next(iter(block["rotation"]["fixed_streams"])) and block["structure"] == {}


@pytest.mark.parametrize("method", ["hadamard", pytest.param("orthogonal", marks=pytest.mark.slow)])
def test_vit_rotates_and_says_which_output_is_rotated(tmp_path, method):
    torch.manual_seed(0)
    src, out, block = _rotated(tmp_path, T.ViTModel(T.ViTConfig(**VIT)), "vit", method)
    assert block["verification"]["passed"] and block["rotation"]["rotated_outputs"] == {"last_hidden_state": "layernorm"}
    original, rotated = load(src, "original", torch.float64, "AutoModel"), load(out, "stock", torch.float64, "AutoModel")
    with torch.no_grad():
        expected, got = original(pixel_values=pixels().double()), rotated(pixel_values=pixels().double())
    assert torch.allclose(got.pooler_output, expected.pooler_output, atol=1e-9)
    q, norm = load_rotation(out), original.layernorm
    assert torch.allclose(got.last_hidden_state, ((expected.last_hidden_state - norm.bias) / norm.weight) @ q, atol=1e-9)
    # the classifier class: the logits are the compared output
    torch.manual_seed(0)
    classifier = _tiny(tmp_path, T.ViTForImageClassification(T.ViTConfig(**VIT, num_labels=3)), "vit-cls")
    block = rotate_checkpoint(classifier, tmp_path / "rotated-cls", method=method, verification="auto")
    assert block["verification"]["passed"]


def _clip_inputs() -> dict:
    ids = torch.randint(2, 48, (2, 7), generator=torch.Generator().manual_seed(2))
    ids[:, -1] = 49
    return {"input_ids": ids, "pixel_values": pixels().double()}


@pytest.mark.parametrize("method", ["hadamard", pytest.param("orthogonal", marks=pytest.mark.slow)])
def test_clip_text_tower_rotates_vision_tower_stays(tmp_path, method):
    torch.manual_seed(0)
    model = T.CLIPModel(T.CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=24))
    src, out, block = _rotated(tmp_path, model, "clip", method)
    assert block["verification"]["passed"]
    original, rotated = load(src, "original", torch.float64, "AutoModel"), load(out, "stock", torch.float64, "AutoModel")
    with torch.no_grad():
        expected, got = original(**_clip_inputs()), rotated(**_clip_inputs())
    for key in ("logits_per_image", "text_embeds", "image_embeds"):
        assert torch.allclose(getattr(got, key), getattr(expected, key), atol=1e-9), key
    assert torch.allclose(got.vision_model_output.last_hidden_state, expected.vision_model_output.last_hidden_state)
    q, gain = load_rotation(out), original.text_model.final_layer_norm.weight
    # β ⊘ γ stayed in the norm (text_projection has no bias): the text stream comes out as (h ⊘ γ)·Q
    assert block["rotation"]["rotated_outputs"] == {"text_model_output.last_hidden_state": "text_model.final_layer_norm"}
    assert torch.allclose(got.text_model_output.last_hidden_state,
                          (expected.text_model_output.last_hidden_state / gain) @ q, atol=1e-9)
    assert torch.allclose(got.text_model_output.pooler_output, expected.text_model_output.pooler_output, atol=1e-9)


@pytest.mark.parametrize(("model", "needle"), [
    (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**CLIP_VISION)), "pre_layrnorm"),
    (lambda: T.CLIPTextModel(T.CLIPTextConfig(**CLIP_TEXT)), "text_projection"),
], ids=["clip-vision", "clip-text-without-projection"])  # fmt: skip
def test_clip_towers_without_a_rotatable_function_are_refused(tmp_path, capsys, model, needle):
    src = save(model(), tmp_path / "src")
    code, err = run_cli(capsys, "rotate", str(src), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, needle)


def with_processors(src: Path, kind: str) -> Path:
    """A tiny encoder checkpoint made calibratable: the bundled tokenizer (2048 ids) where it reads
    text, and a processor whose output has the tiny model's shape (Whisper: 8 mel bins, 32 frames)."""
    if kind in ("whisper", "clip"):
        for name in TOKENIZER_FILES:
            (src / name).write_bytes((BUNDLED / "austen-gpt2" / name).read_bytes())
    if kind == "whisper":
        T.WhisperFeatureExtractor(feature_size=WHISPER["num_mel_bins"], sampling_rate=16000, chunk_length=1,
                                  hop_length=500, n_fft=1000).save_pretrained(src)
    if kind == "vit":
        T.ViTImageProcessor(size={"height": VIT["image_size"], "width": VIT["image_size"]}).save_pretrained(src)
    return src


def calibratable_encoders() -> dict:
    """name -> (model builder, Auto class, forward giving the compared output) of the encoder families."""
    def clip(model):
        out = model(**{key: value.to(model.dtype) if value.is_floating_point() else value
                       for key, value in _clip_inputs().items()})
        return torch.cat([out.logits_per_image.flatten(), out.text_embeds.flatten(), out.image_embeds.flatten()])

    return {
        "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(**{**WHISPER, "vocab_size": 2048})),
                    "AutoModelForSpeechSeq2Seq", lambda model: whisper_logits(model, whisper_inputs())),
        "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(**VIT, num_labels=3)), "AutoModelForImageClassification",
                lambda model: model(pixel_values=pixels().to(model.dtype)).logits),
        "clip": (lambda: T.CLIPModel(T.CLIPConfig(text_config={**CLIP_TEXT, "vocab_size": 2048}, vision_config=CLIP_VISION,
                                                  projection_dim=24)), "AutoModel", clip),
    }


@pytest.mark.parametrize("kind", ["whisper", pytest.param("vit", marks=pytest.mark.slow),
                                  pytest.param("clip", marks=pytest.mark.slow)])
def test_pca_calibrates_on_what_the_model_reads(tmp_path, kind):
    """Whisper on the bundled transcribed speech (decoder tokens, encoder on the audio), ViT on the
    bundled images, CLIP's text tower on text: Q·1 = 1, exact in the stock class, the inputs recorded."""
    build, auto, forward = calibratable_encoders()[kind]
    torch.manual_seed(0)
    src = with_processors(_tiny(tmp_path, build(), kind), kind)
    block = rotate_checkpoint(src, tmp_path / "pca", method="pca", calibration="bundled", dtype=torch.float64,
                              verification="full")
    assert block["verification"]["passed"]
    calibration = block["rotation"]["calibration"]
    assert {"whisper": "audio", "vit": "images", "clip": "text"}[kind] in calibration and calibration["tokens"] > 0
    assert commuting.commutes_with_centring(load_rotation(tmp_path / "pca"))
    with torch.no_grad():
        reference = forward(load(src, "original", torch.float64, auto)).double()
        error = float((forward(load(tmp_path / "pca", "stock", torch.float64, auto)).double() - reference).abs().max())
    assert error <= 1e-9 * max(1.0, float(reference.abs().max()))


def test_pca_of_an_image_model_refuses_text(tmp_path, capsys):
    torch.manual_seed(0)
    src = save(T.ViTModel(T.ViTConfig(**VIT)), tmp_path / "vit")
    code, err = run_cli(capsys, "rotate", str(src), "--out", str(tmp_path / "out"), "--method", "pca",
                        "--calibration", str(CALIBRATION))
    assert_one_line_error(code, err, "calibrated on images, not text")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# A stock consumer takes the output: transformers' Auto class, generate, lm-eval's hf model


def _stock_causal(path: Path) -> torch.nn.Module:
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # no trust_remote_code
    assert type(model).__module__.startswith("transformers.models.")
    return model.eval()


@pytest.mark.parametrize("case", ["gpt2-bundled", "opt-tied"])
def test_stock_generate_matches_the_original(tmp_path, case):
    if case == "gpt2-bundled":
        from normswap.checkpoint.source import example_model_path

        src = example_model_path()
        tokenizer = T.AutoTokenizer.from_pretrained(src)
        prompt = tokenizer("It is a truth universally acknowledged, that", return_tensors="pt").input_ids
    else:
        src, prompt = make_source(tmp_path, case), token_ids(VOCAB, batch=1, length=6)
    rotated = tmp_path / "rotated"
    rotate_checkpoint(src, rotated)  # the default: commuting hadamard, verified
    assert "auto_map" not in json.loads((rotated / "config.json").read_text())
    outputs = []
    for path in (src, rotated):
        with torch.no_grad():
            outputs.append(_stock_causal(path).generate(prompt, max_new_tokens=24, do_sample=False,
                                                        attention_mask=torch.ones_like(prompt), pad_token_id=0))
    assert torch.equal(outputs[0], outputs[1]) and outputs[0].shape[1] == prompt.shape[1] + 24


@pytest.mark.slow
def test_lm_eval_hf_model_scores_the_rotated_checkpoint_as_the_original(tmp_path):
    """lm-eval's own ``--model hf`` (HFLM from a path, no remote code) on the local tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from normswap.checkpoint.source import example_model_path
    from normswap.evaluation.local_tasks import materialise_tasks

    rotated = tmp_path / "rotated"
    rotate_checkpoint("normswap:austen-gpt2", rotated, verification="none")
    tasks = ["persuasion_cloze", "persuasion_lastword"]
    manager = TaskManager(include_defaults=False, include_path=str(materialise_tasks(tmp_path / "tasks", tasks)))
    scores = []
    for path in (example_model_path(), rotated):
        raw = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={path},dtype=float32,device=cpu", tasks=tasks,
                                      task_manager=manager, limit=40, bootstrap_iters=0, batch_size=8)
        scores.append({f"{task}/{key}": value for task, metrics in raw["results"].items()
                       for key, value in metrics.items() if isinstance(value, float)})
    assert scores[0].keys() == scores[1].keys() and "persuasion_cloze/acc,none" in scores[0]
    for key, value in scores[0].items():
        assert abs(scores[1][key] - value) <= 1e-4 * max(1.0, abs(value)), (key, value, scores[1][key])
