"""Causal-LM families: exact conversion against a float64 reference, for every adapter variant.

Each case is a tiny random model (2 layers, hidden 32) made hard by ``make_hard`` (γ far from 1,
β far from 0, embeddings and biases with a large mean, one massive dimension). It is converted
twice: with float64 weights (no built-in verification, compared to 1e-9) and with float32 weights
(built-in verification on, compared to 1e-4 · max|logit|), and both are loaded through the stock
class, the remote-code RMSNorm class and ``normswap.load``, whose logits
must match the float64 original's. BLOOM's output has its own model type: stock transformers
refuses it (tested separately), so only the RMSNorm loaders run.

Every variant runs with ``--fold-gains`` (where the adapter's reader wiring matters); the first
variant of each family also runs without it (where only the writers matter, shared by variants).
Four cases are in the quick loop (``QUICK``); the others are marked slow.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import causal_logits, check_exact, converted_dir, load, make_hard, save, token_ids

import normswap
from normswap.errors import NormswapError

VOCAB = 61
SMALL = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}


def _neox(**kwargs):
    return transformers.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32, **SMALL, **kwargs)


def _opt(**kwargs):
    return transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                  max_position_embeddings=32, **SMALL, **kwargs)


def _falcon(**kwargs):
    return transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **SMALL, **kwargs)


# id -> config. Ids start with the model type; the first id of a family also runs without folding.
CASES = {
    "gpt_neo-tied-local": lambda: transformers.GPTNeoConfig(
        num_layers=2, hidden_size=32, num_heads=4, intermediate_size=64, max_position_embeddings=32,
        attention_types=[[["global", "local"], 1]], window_size=4, **SMALL),
    "gptj-tied-headbias": lambda: transformers.GPTJConfig(
        n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=32, tie_word_embeddings=True, **SMALL),
    "gpt_neox-parallel-untied": lambda: _neox(use_parallel_residual=True, tie_word_embeddings=False),
    "gpt_neox-sequential-tied-nobias": lambda: _neox(use_parallel_residual=False, tie_word_embeddings=True,
                                                     attention_bias=False),
    "opt-tied": lambda: _opt(word_embed_proj_dim=32),
    "opt-projected": lambda: _opt(word_embed_proj_dim=16),
    "opt-nobias": lambda: _opt(word_embed_proj_dim=32, enable_bias=False),
    "opt-nonaffine": lambda: _opt(word_embed_proj_dim=32, layer_norm_elementwise_affine=False),
    "bloom-baked": lambda: transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **SMALL),
    "phi-untied-headbias": lambda: transformers.PhiConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, partial_rotary_factor=0.5, tie_word_embeddings=False, **SMALL),
    "phi-tied-headbias": lambda: transformers.PhiConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, partial_rotary_factor=0.5, tie_word_embeddings=True, **SMALL),
    "falcon-new-ln_attn-ln_mlp-gqa": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
    "falcon-new-one-ln": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    "falcon-new-bias": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2, bias=True),
    "falcon-parallel-alibi": lambda: _falcon(new_decoder_architecture=False, parallel_attn=True, multi_query=True,
                                             alibi=True),
    "falcon-parallel-mqa": lambda: _falcon(new_decoder_architecture=False, parallel_attn=True, multi_query=True),
    "falcon-sequential-alibi-bias": lambda: _falcon(new_decoder_architecture=False, parallel_attn=False,
                                                    multi_query=False, alibi=True, bias=True),
    "gpt_bigcode-mqa": lambda: transformers.GPTBigCodeConfig(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, multi_query=True, **SMALL),
    "gpt_bigcode-mha": lambda: transformers.GPTBigCodeConfig(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, multi_query=False, **SMALL),
    "codegen-untied-headbias": lambda: transformers.CodeGenConfig(
        n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=32, **SMALL),
}
# checkpoints the stock class cannot hold (a baked embedding norm): they get their own model type
OWN_TYPE = {"bloom"}
# float64 agreement per family. BLOOM's attention runs its softmax in float32 even in a float64
# model, so two float64 runs whose inputs differ by rounding noise (1e-16) agree only to float32
# rounding of the probabilities; the other families' float64 runs stay in float64 (default
# attention implementation) and agree to 1e-9.
FP64_TOL = {"bloom": 1e-6}


def _written(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as file:
        return set(file.keys())


def _family(case: str) -> str:
    return case.split("-")[0]


# in the quick loop (-m "not slow"): a β kept as β/γ (no bias slot), a variant's wiring, a baked
# embedding norm, a parallel block; the other cases are slow
QUICK = {"gpt_neox-sequential-tied-nobias", "opt-projected", "bloom-baked", "falcon-parallel-alibi"}


def _params():
    seen = set()
    for case in CASES:
        quick = () if case in QUICK else (pytest.mark.slow,)
        yield pytest.param(case, True, id=f"{case}-fold", marks=quick)
        if _family(case) not in seen:
            seen.add(_family(case))
            yield pytest.param(case, False, id=f"{case}-plain", marks=pytest.mark.slow)


def make_source(tmp_path, case: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    config = CASES[case]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    return save(make_hard(model).to(dtype).eval(), tmp_path / f"{case}-src")


@pytest.mark.parametrize(("case", "fold_gains"), list(_params()))
def test_causal_family_is_exact(tmp_path, case, fold_gains):
    src = make_source(tmp_path, case)
    own_type = _family(case) in OWN_TYPE
    loaders = ("remote",) if own_type else ("stock", "remote")

    def holds_every_tensor(out, how, model):
        # the class holds every converted tensor (a β with no bias slot stays in its norm) and has
        # no parameter the checkpoint leaves to initialisation
        if how == loaders[0]:
            assert _written(out) == set(model.state_dict())

    check_exact(src, tmp_path, inputs=token_ids(VOCAB), fold_gains=fold_gains, loaders=(*loaders, "normswap"),
                fp64_tol=FP64_TOL.get(_family(case), 1e-9), check_model=holds_every_tensor)
    out = converted_dir(src, tmp_path, torch.float32, fold_gains)
    config = json.loads((out / "config.json").read_text())
    assert config["normswap"]["stock_loadable"] is (not own_type)
    if fold_gains:  # every norm with a gain is folded, except a baked one (which is gone)
        source_names = _written(src)
        provenance = config["normswap"]
        baked = set(provenance["structure"].get("identity", []))
        with_gain = {name for name in provenance["norms_swapped"] if f"{name}.weight" in source_names}
        assert set(provenance["norms_folded"]) == with_gain - baked


@pytest.mark.slow
def test_bloom_embedding_norm_is_baked_and_stock_refuses(tmp_path):
    """The baked checkpoint has no embedding norm; stock transformers (whose BloomModel would
    apply one again) must refuse it, and the RMSNorm class replaces that norm by an identity."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    src = make_source(tmp_path, "bloom-baked")
    out = tmp_path / "rms"
    block = normswap.convert_checkpoint(src, out)
    assert block["structure"]["identity"] == ["transformer.word_embeddings_layernorm"]
    assert block["verification"]["loaders"]["stock"] == {"refused": True}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "normswap_bloom" and config["model_type"] not in CONFIG_MAPPING_NAMES
    state = load_file(out / "model.safetensors")
    assert not any("word_embeddings_layernorm" in name for name in state)
    assert state["transformer.word_embeddings.weight"].double().mean(-1).abs().max() < 1e-6
    # the untied head keeps the original table
    original = load_file(src / "model.safetensors")["transformer.word_embeddings.weight"]
    assert torch.equal(state["lm_head.weight"], original)
    # stock transformers, without normswap imported (which registers normswap_bloom), refuses
    code = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "trust_remote_code" in result.stderr


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (lambda: _opt(word_embed_proj_dim=32, do_layer_norm_before=False), "post-LN"),
        (lambda: _opt(word_embed_proj_dim=32, _remove_final_layer_norm=True), "final LayerNorm was removed"),
        (lambda: transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4,
                                          apply_residual_connection_post_layernorm=True, **SMALL),
         "norms write the stream"),
        (lambda: transformers.PhiConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, qk_layernorm=True, **SMALL), "qk_layernorm"),
        # rotary positions turn pairs of a head's coordinates: refused before any weight is read
        (lambda: transformers.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=99, **SMALL),
         "'rotary_dim' = 99 exceeds the head dimension 8"),
        (lambda: transformers.CodeGenConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=3, **SMALL),
         "gives 3 rotary coordinates per head, an odd number"),
        (lambda: transformers.PhiConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, partial_rotary_factor=2.0, **SMALL),
         "'rope_parameters.partial_rotary_factor' must be a number from 0 to 1"),
    ],
    ids=["opt-post-ln", "opt-no-final-norm", "bloom-post-ln-residual", "phi-qk-layernorm", "gptj-rotary_dim-above-head",
         "codegen-rotary_dim-odd", "phi-partial_rotary_factor-above-1"],
)
def test_refusals(tmp_path, overrides, reason):
    config = overrides()
    src = tmp_path / "src"
    model = transformers.AutoModelForCausalLM.from_config(config)
    save(model, src)
    with pytest.raises(NormswapError, match=reason):
        normswap.convert_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# lines ``inspect --fold-gains`` must print for a case: what the adapter says about each family
INSPECT_LINES = {
    "gptj-tied-headbias": [
        # one norm feeds the parallel attention and MLP; q/k/v have no bias slot, so β/γ stays
        "  transformer.h.0.ln_1: read by transformer.h.0.attn.q_proj.weight, transformer.h.0.attn.k_proj.weight, "
        "transformer.h.0.attn.v_proj.weight, transformer.h.0.mlp.fc_in.weight [gains folded, keeps β/γ]",
        "  transformer.ln_f: read by lm_head.weight [gains folded]",
        "tied head: lm_head.weight untied from transformer.wte.weight",
    ],
    "opt-projected": [
        "  model.decoder.final_layer_norm: read by model.decoder.project_out.weight [gains folded, keeps β/γ]",
        "  model.decoder.project_in.weight",
        "  model.decoder.embed_positions.weight",
        "tied head: lm_head.weight untied from model.decoder.embed_tokens.weight",
    ],
    "bloom-baked": [
        "  transformer.word_embeddings_layernorm: baked into transformer.word_embeddings.weight "
        "[not folded: baked into the table; nothing left to fold]",
        "  transformer.h.1.input_layernorm: read by transformer.h.1.self_attention.query_key_value.weight [gains folded]",
        "structural changes: {'identity': ['transformer.word_embeddings_layernorm']}",
    ],
    "falcon-sequential-alibi-bias": [
        "  transformer.h.0.post_attention_layernorm: read by transformer.h.0.mlp.dense_h_to_4h.weight [gains folded]",
        "  transformer.h.0.input_layernorm: read by transformer.h.0.self_attention.query_key_value.weight "
        "[gains folded]",
        "  transformer.word_embeddings.weight",
    ],
}


@pytest.mark.parametrize("case", sorted(INSPECT_LINES))
def test_inspect(tmp_path, case, capsys):
    """inspect prints the plan itself: every norm with its readers, every tensor it centres."""
    from normswap.checkpoint.source import CheckpointReader, read_config
    from normswap.cli import main
    from normswap.convert.pipeline import plan_conversion

    src = make_source(tmp_path, case)
    before = sorted(tmp_path.rglob("*"))
    assert main(["inspect", str(src), "--fold-gains"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "exact conversion: possible" in lines
    for line in INSPECT_LINES[case]:
        assert line in lines
    with CheckpointReader(src) as reader:
        _, plan, _ = plan_conversion(src, read_config(src), reader, method="exact", fold_gains=True, dtype=None)
    norms = lines.index(f"norms ({len(plan.norms)}):")
    assert [line.split(":")[0].strip() for line in lines[norms + 1:norms + 1 + len(plan.norms)]] == [
        norm.name for norm in plan.norms]
    writers = lines.index(f"tensors to centre ({len(plan.writers)}):")
    assert [line.strip() for line in lines[writers + 1:writers + 1 + len(plan.writers)]] == list(plan.writers)
    assert sorted(tmp_path.rglob("*")) == before  # inspect writes nothing


def test_tie_flag_defaults_to_the_config_class(tmp_path):
    """A config.json without ``tie_word_embeddings`` means "untied" for CodeGen (its config class
    defaults to False), so the checkpoint's own head must be kept, not replaced by the embedding."""
    src = make_source(tmp_path, "codegen-untied-headbias")
    config = json.loads((src / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (src / "config.json").write_text(json.dumps(config))
    block = normswap.convert_checkpoint(src, tmp_path / "out", fold_gains=True, dtype=torch.float64,
                                        verification="none")
    assert block["untied"] == []
    ids = token_ids(VOCAB)
    reference = causal_logits(load(src, "original", torch.float64), ids)
    converted = causal_logits(load(tmp_path / "out", "stock", torch.float64), ids)
    assert float((converted - reference).abs().max()) < 1e-9


def test_bloom_layerwise_verification(tmp_path):
    """Large checkpoints (> 1 GiB in float32, so every real BLOOM) are verified layer by layer."""
    src = make_source(tmp_path, "bloom-baked")
    block = normswap.convert_checkpoint(src, tmp_path / "out", verification="layerwise")
    assert block["verification"]["mode"] == "layerwise"
    assert block["verification"]["loaders"]["stock"] == {"refused": True}
