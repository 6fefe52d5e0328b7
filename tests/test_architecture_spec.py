"""The adapters' name dialect (templates compiled to regexes) and the declarative helpers."""

from __future__ import annotations

import re
import string

import pytest
import torch
from torch import nn

from normswap.architectures import ARCHITECTURES, CENTRE_INPUT, CENTRE_OUTPUT, IDENTITY, STRUCTURE_KINDS
from normswap.architectures.spec import (
    CONV1D_IN_AXIS,
    CONV1D_OUT_AXIS,
    LINEAR_IN_AXIS,
    LINEAR_OUT_AXIS,
    Norm,
    Writer,
    assemble,
    attention_readers,
    conv1d_reader,
    embeddings,
    linear_reader,
    linear_writers,
    lm_head,
    pattern,
    pre_ln_blocks,
    refuse_if,
)
from normswap.modeling import remote


def test_pattern_layer_and_alternatives():
    regex = pattern("transformer.h.{layer}.{attn|mlp}.c_proj.weight")
    assert regex == r"transformer\.h\.(?P<layer>\d+)\.(attn|mlp)\.c_proj\.weight"
    assert re.fullmatch(regex, "transformer.h.11.mlp.c_proj.weight").group("layer") == "11"
    assert not re.fullmatch(regex, "transformer.h.1.attn.c_proj.bias")
    assert not re.fullmatch(regex, "transformerXh.1.attn.c_proj.weight")  # dots are literal


def test_pattern_named_choice_fills_readers():
    norm = Norm("{base=model.|}decoder.layers.{layer}.final_layer_norm", (linear_reader("{base=model.|}decoder.layers.{layer}.fc1"),))
    for prefix in ("model.", ""):
        groups = re.fullmatch(norm.pattern, f"{prefix}decoder.layers.3.final_layer_norm").groupdict()
        assert groups == {"base": prefix, "layer": "3"}
        (reader,) = norm.readers
        assert reader.weight.format(**groups) == f"{prefix}decoder.layers.3.fc1.weight"
        assert reader.bias.format(**groups) == f"{prefix}decoder.layers.3.fc1.bias"
    assert not re.fullmatch(norm.pattern, "other.decoder.layers.3.final_layer_norm")


def test_bad_templates_are_refused():
    with pytest.raises(ValueError, match="unknown placeholder"):
        pattern("transformer.h.{block}.ln_1")
    with pytest.raises(ValueError, match="alternatives"):
        _ = linear_reader("transformer.h.{layer}.{attn|mlp}.c_fc").weight


def test_linear_helpers():
    weight, bias = linear_writers("h.{layer}.out")
    assert (weight.name, weight.hidden_axis, bias.name, bias.hidden_axis) == ("h.{layer}.out.weight", LINEAR_OUT_AXIS,
                                                                            "h.{layer}.out.bias", 0)
    assert linear_writers("h.{layer}.c_proj", conv1d=True)[0].hidden_axis == CONV1D_OUT_AXIS
    reader = linear_reader("lm_head", bias=False)
    assert (reader.weight, reader.bias, reader.input_axis) == ("lm_head.weight", None, LINEAR_IN_AXIS)
    q, k, v = attention_readers("l.{layer}.attn", key_bias=False)
    assert k.bias is None and k.constant_cancels and not q.constant_cancels and q.bias == "l.{layer}.attn.q_proj.bias"
    assert v.input_axis == LINEAR_IN_AXIS != CONV1D_IN_AXIS


def test_block_helpers_name_readers_within_the_block():
    blocks = pre_ln_blocks("t.h", writes="{attn|mlp}.c_proj", conv1d=True, ln_1=conv1d_reader("attn.c_attn"),
                           ln_2=(linear_reader("mlp.a"), linear_reader("mlp.b", bias=False)))
    assert blocks.writers == linear_writers("t.h.{layer}.{attn|mlp}.c_proj", conv1d=True)
    assert blocks.norms == (
        Norm("t.h.{layer}.ln_1", (conv1d_reader("t.h.{layer}.attn.c_attn"),)),
        Norm("t.h.{layer}.ln_2", (linear_reader("t.h.{layer}.mlp.a"), linear_reader("t.h.{layer}.mlp.b", bias=False))),
    )
    head = lm_head("t.ln_f", tied_to="t.wte.weight")
    assert head.norms == (Norm("t.ln_f", (linear_reader("lm_head", bias=False),)),)
    assert head.tied == (("lm_head.weight", "t.wte.weight"),)
    assert lm_head("t.ln_f", head="out", bias=True).tied == ()


def test_assemble_joins_parts_in_order():
    final = Norm("t.ln_f", output_is_model_output=True)
    position = Writer("t.wpe.weight", hidden_axis=1)
    blocks = pre_ln_blocks("t.h", writes="mlp.fc2", ln=linear_reader("mlp.fc1"))
    architecture = assemble("toy", "AutoModel", embeddings("t.wte.weight"), position, blocks, final, blocks="t.h")
    assert architecture.model_types == ("toy",) and architecture.auto_class == "AutoModel"
    assert architecture.writers == (Writer("t.wte.weight", 1), position, *blocks.writers)
    assert architecture.norms == (*blocks.norms, final)
    assert architecture.tied == () and architecture.blocks == "t.h"


def test_refuse_if():
    refuse = refuse_if(a="a is set", b="b is set")
    assert refuse({}) is None and refuse({"a": False}) is None
    assert refuse({"b": True}) == "b is set"


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_adapter_template_compiles_and_fills(model_type):
    """Every pattern compiles, and each reader's template is filled by its norm's named groups."""
    architecture = ARCHITECTURES[model_type]
    variants = [architecture] + [architecture.for_config(config) for config in (
        {"word_embed_proj_dim": 16, "hidden_size": 32}, {"parallel_attn": False})]
    for adapter in variants:
        for regex in [w.pattern for w in adapter.writers] + list(adapter.ignore):
            re.compile(regex)
        for norm in adapter.norms:
            groups = {name: "0" for name in re.compile(norm.pattern).groupindex}
            for reader in norm.readers:
                for template in (reader.weight, reader.bias):
                    if template is not None:
                        fields = {field for _, field, _, _ in string.Formatter().parse(template) if field}
                        assert fields <= set(groups), (norm.module, template)
        for kind in adapter.structure({"model_type": model_type}):
            assert kind in STRUCTURE_KINDS


def test_structure_kinds_are_what_the_modeling_file_applies():
    """modeling/remote.py spells the structure keys itself (it imports nothing from normswap)."""
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 4))
    remote.apply_structure(model, {IDENTITY: ["0"], CENTRE_INPUT: ["1"], CENTRE_OUTPUT: ["2"]})
    assert isinstance(model[0], nn.Identity)
    assert model[1]._forward_pre_hooks and model[2]._forward_hooks
    output = model(torch.randn(3, 4) + 5.0)
    assert output.mean(-1).abs().max() < 1e-6


def test_plan_structure_is_typed_with_the_stored_keys():
    """The plan's typed Structure stores exactly the kinds adapters declare and remote.py applies."""
    from dataclasses import fields

    from normswap.convert.steps import Structure
    from normswap.errors import NormswapError

    assert {field.name for field in fields(Structure)} == set(STRUCTURE_KINDS)
    structure = Structure.from_json({CENTRE_OUTPUT: ["pre"]})
    assert structure.centres and not structure.identity and structure.to_json() == {CENTRE_OUTPUT: ["pre"]}
    with pytest.raises(NormswapError, match="unknown structural change"):
        Structure.from_json({"shift": ["x"]})
