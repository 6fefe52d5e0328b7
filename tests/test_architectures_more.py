"""The families beyond the first fourteen: exact against a float64 reference, stock and RMSNorm class.

Each case is a tiny random model (2 layers, width 32) made hard (``make_hard``, and the same for
a family's own LayerNorm classes: OLMo's weightless norm, Cohere's bias-free and per-head ones),
converted with ``--fold-gains`` in float64 (compared to 1e-9) and float32 (built-in verification
on, compared to 1e-4·max|output|) and loaded through the stock class and the RMSNorm class. Each
new form has its own case: per-head q/k norms (StableLM, Persimmon, Cohere), a weightless norm
(OLMo), γ stored as γ - 1 (Nemotron), LayerScale (DINOv2, BEiT), a norm on the embeddings
(mBART), positions computed at run time (XGLM, M2M100, Pegasus).
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from helpers import check_exact, make_hard, save, token_ids, vision_outputs

from normswap.modeling.remote import layer_norm_like

VOCAB = 61
SMALL = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
LLAMA_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=32, **SMALL)

CAUSAL = {
    "ctrl": lambda: T.CTRLConfig(n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=32, vocab_size=VOCAB),
    "xglm": lambda: T.XGLMConfig(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64, max_position_embeddings=32,
                                 **SMALL),
    "biogpt": lambda: T.BioGptConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=32, **SMALL),
    "starcoder2": lambda: T.Starcoder2Config(**LLAMA_LIKE, num_key_value_heads=2),
    "stablelm-qk-norm": lambda: T.StableLmConfig(**LLAMA_LIKE, num_key_value_heads=2, qk_layernorm=True,
                                                 use_qkv_bias=True),
    "stablelm-parallel": lambda: T.StableLmConfig(**LLAMA_LIKE, num_key_value_heads=4, use_parallel_residual=True),
    "persimmon": lambda: T.PersimmonConfig(**LLAMA_LIKE, qk_layernorm=True),
    "olmo": lambda: T.OlmoConfig(**LLAMA_LIKE, clip_qkv=8.0),
    "cohere-qk-norm": lambda: T.CohereConfig(**LLAMA_LIKE, num_key_value_heads=2, use_qk_norm=True),
    "nemotron": lambda: T.NemotronConfig(**LLAMA_LIKE, num_key_value_heads=2, head_dim=8),
    "mpt": lambda: T.MptConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=64, vocab_size=VOCAB, no_bias=False),
}


# float64 agreement per family: OLMo's and Cohere's own LayerNorm classes compute in float32 even
# in a float64 model, so two float64 runs agree to float32 rounding there; the others to 1e-9
FP64_TOL = {"olmo": 1e-6, "cohere-qk-norm": 1e-6}


@torch.no_grad()
def make_harder(model: torch.nn.Module) -> torch.nn.Module:
    """``make_hard``, and gains far from 1 for norms of a family's own class too."""
    make_hard(model)
    generator = torch.Generator().manual_seed(7)
    for module in model.modules():
        if layer_norm_like(module) and not isinstance(module, torch.nn.LayerNorm):
            for name, value in (("weight", 0.5), ("bias", 0.0)):
                tensor = getattr(module, name, None)
                if tensor is not None:
                    tensor.copy_(value + 1.5 * torch.rand(tensor.shape, generator=generator) - 0.5 * (name == "bias"))
    return model


def _source(tmp_path, name, model):
    return save(make_harder(model).eval(), tmp_path / f"{name}-src")


@pytest.fixture
def float64_scalars(request):
    """XGLM's attention clamps with ``torch.full((), finfo(dtype).min)``, a tensor of the default
    dtype, which overflows for a float64 model under a float32 default; run it under float64."""
    default = torch.get_default_dtype()
    if request.node.callspec.params.get("case") == "xglm":
        torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


@pytest.mark.parametrize("case", sorted(CAUSAL))
def test_causal_family_is_exact(tmp_path, case, float64_scalars):
    torch.manual_seed(0)
    src = _source(tmp_path, case, T.AutoModelForCausalLM.from_config(CAUSAL[case]()))
    errors = check_exact(src, tmp_path, inputs=token_ids(VOCAB), fold_gains=True, fp64_tol=FP64_TOL.get(case, 1e-9))
    print(case, {key: f"{value:.2e}" for key, value in errors.items()})


BART_LIKE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, scale_embedding=True,
                 decoder_start_token_id=2, **SMALL)
SEQ2SEQ = {
    "m2m_100": lambda: T.M2M100Config(**BART_LIKE),
    "mbart": lambda: T.MBartConfig(**BART_LIKE),
    "pegasus": lambda: T.PegasusConfig(**BART_LIKE),
    "blenderbot": lambda: T.BlenderbotConfig(**BART_LIKE),
}


@torch.no_grad()
def seq2seq_logits(model, ids):
    return model(input_ids=ids, decoder_input_ids=ids.flip(-1)).logits.double()


@pytest.mark.parametrize("case", sorted(SEQ2SEQ))
def test_seq2seq_family_is_exact(tmp_path, case):
    torch.manual_seed(0)
    src = _source(tmp_path, case, T.AutoModelForSeq2SeqLM.from_config(SEQ2SEQ[case]()))
    errors = check_exact(src, tmp_path, forward=seq2seq_logits, inputs=token_ids(VOCAB), auto="AutoModelForSeq2SeqLM",
                         fold_gains=True)
    print(case, {key: f"{value:.2e}" for key, value in errors.items()})


VIT_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8)
CLASSIFY = "AutoModelForImageClassification"
VISION = {
    "deit": (T.DeiTForImageClassification, CLASSIFY, lambda: T.DeiTConfig(**VIT_LIKE, intermediate_size=37,
                                                                          num_labels=3)),
    "dinov2-layerscale": (T.Dinov2Model, "AutoModel", lambda: T.Dinov2Config(**VIT_LIKE, layerscale_value=0.3)),
    "beit-layerscale": (T.BeitForImageClassification, CLASSIFY, lambda: T.BeitConfig(
        **VIT_LIKE, intermediate_size=37, num_labels=3, layer_scale_init_value=0.3, use_relative_position_bias=True)),
}


@torch.no_grad()
def _scale_layers(model):
    """LayerScale's λ far from its constant init, so folding it matters."""
    generator = torch.Generator().manual_seed(11)
    for name, parameter in model.named_parameters():
        if "lambda" in name:
            parameter.copy_(0.2 + torch.rand(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize("case", sorted(VISION))
def test_vision_family_is_exact(tmp_path, case):
    model_class, auto, config = VISION[case]
    torch.manual_seed(0)
    src = _source(tmp_path, case, _scale_layers(model_class(config())))
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    errors = check_exact(src, tmp_path, forward=vision_outputs, inputs=pixels, auto=auto, fold_gains=True)
    print(case, {key: f"{value:.2e}" for key, value in errors.items()})


def test_dinov2_swiglu_refused_for_its_fused_checkpoint_names(tmp_path):
    """The class holds gate_proj/up_proj, the checkpoint it saves holds them fused as weights_in:
    a split on load, which the conversion does not follow; refused in one line, nothing written."""
    from safetensors import safe_open

    import normswap
    from normswap.errors import NormswapError

    model = T.Dinov2Model(T.Dinov2Config(**VIT_LIKE, use_swiglu_ffn=True))
    assert "encoder.layer.0.mlp.gate_proj.weight" in model.state_dict()
    src = save(model, tmp_path / "src")
    with safe_open(src / "model.safetensors", "pt") as file:
        assert "encoder.layer.0.mlp.weights_in.weight" in set(file.keys())
    with pytest.raises(NormswapError, match="weights_in"):
        normswap.convert_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_inspect_names_the_tensors_the_checkpoint_holds(tmp_path, capsys):
    """DINOv2's files hold attention.attention.query / attention.output.dense, which transformers 5
    renames on load (q_proj, o_proj): the plan is shown under the files' own names."""
    from normswap.cli import main

    src = save(T.Dinov2Model(T.Dinov2Config(**VIT_LIKE)), tmp_path / "src")
    assert main(["inspect", str(src)]) == 0
    shown = capsys.readouterr().out
    assert "read by encoder.layer.0.attention.attention.query.weight" in shown
    assert "  encoder.layer.1.attention.output.dense.weight\n" in shown
    assert "o_proj" not in shown.split("written under")[0]
    assert "encoder.layer.0.attention.attention.key.bias -> encoder.layer.0.attention.k_proj.bias" in shown


# the commuting rotation: a stream whose first write is computed at run time (sinusoidal
# positions) or is a norm's output (mBART's layernorm_embedding) is refused in one line; a
# LayerScale folds into its writer first, so BEiT rotates and verifies through the stock class
ROTATE_CASES = {
    "xglm": (lambda: T.AutoModelForCausalLM.from_config(CAUSAL["xglm"]()), "computed at run time"),
    "mbart": (lambda: T.AutoModelForSeq2SeqLM.from_config(SEQ2SEQ["mbart"]()), "layernorm_embedding"),
    "beit-layerscale": (lambda: _scale_layers(VISION["beit-layerscale"][0](VISION["beit-layerscale"][2]())), None),
}


@pytest.mark.parametrize("case", sorted(ROTATE_CASES))
def test_commuting_rotation_of_new_forms(tmp_path, capsys, case):
    from test_bad_input import assert_one_line_error, run_cli

    build, refusal = ROTATE_CASES[case]
    torch.manual_seed(0)
    src = _source(tmp_path, case, build())
    code, err = run_cli(capsys, "rotate", str(src), "--out", str(tmp_path / "rotated"), "--no-progress")
    if refusal is None:
        assert code == 0, err
    else:
        assert code == 2
        assert_one_line_error(code, err, refusal)
        assert not (tmp_path / "rotated").exists()
