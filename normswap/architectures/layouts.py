"""The layouts several families share, as ``Wiring`` pieces built from ``spec``'s.

A family whose model class lays its modules out as another's declares what differs (the module
names of its writers and readers, the final norm) and takes the rest from here: a causal LM's
tables, blocks and head (``decoder``; ``llama_layout`` and ``gpt2_layout`` with those classes'
names), the block as Megatron-LM names it, a gated MLP's readers, the BART lineage's blocks
(``bart_blocks``) and ViT's encoder (``vit_encoder``).
"""

from __future__ import annotations

from typing import Any

from normswap.architectures.spec import (
    Reader,
    Wiring,
    Writer,
    attention_readers,
    embeddings,
    join,
    linear_reader,
    lm_head,
    pre_ln_blocks,
)


def gated_mlp_readers(mlp: str) -> tuple[Reader, Reader]:
    """``gate_proj`` and ``up_proj`` of a gated (SwiGLU-style) ``mlp``, bias-free, reading a norm's output."""
    return linear_reader(f"{mlp}.gate_proj", bias=False), linear_reader(f"{mlp}.up_proj", bias=False)


def megatron_block(attention: str) -> dict[str, Any]:
    """``writes`` and the norms, as keywords of ``pre_ln_blocks`` or ``decoder``, of a block named
    as Megatron-LM names it (GPT-NeoX, BLOOM, Persimmon): ``input_layernorm`` feeds the fused
    ``{attention}.query_key_value``, ``post_attention_layernorm`` feeds ``mlp.dense_h_to_4h``;
    ``{attention}.dense`` and ``mlp.dense_4h_to_h`` write."""
    return {"writes": f"{{{attention}.dense|mlp.dense_4h_to_h}}",
            "input_layernorm": linear_reader(f"{attention}.query_key_value"),
            "post_attention_layernorm": linear_reader("mlp.dense_h_to_4h")}


def decoder(tables: str, layers: str, final_norm: str, *, tied_to: str, writes: str, conv1d: bool = False,
            head_bias: bool = False, **norms: Reader | tuple[Reader, ...]) -> Wiring:
    """A causal LM's stream: ``tables`` write it, then the pre-LN blocks ``{layers}.{layer}``
    (``writes`` and ``norms`` as in ``pre_ln_blocks``), then ``final_norm``, read by ``lm_head``
    (``head_bias``: it has a bias slot), whose weight may be tied to the table ``tied_to``."""
    return join(embeddings(tables), pre_ln_blocks(layers, writes=writes, conv1d=conv1d, **norms),
                lm_head(final_norm, bias=head_bias, tied_to=tied_to))


def llama_layout(*, writes: str, final_norm: str = "model.norm", head_bias: bool = False,
                 **norms: Reader | tuple[Reader, ...]) -> Wiring:
    """A causal LM named as LlamaForCausalLM: the table ``model.embed_tokens``, the blocks
    ``model.layers.{layer}``, and ``final_norm`` read by ``lm_head``, tied to the table."""
    return decoder("model.embed_tokens.weight", "model.layers", final_norm, tied_to="model.embed_tokens.weight",
                   writes=writes, head_bias=head_bias, **norms)


def gpt2_layout(*, writes: str, conv1d: bool = False, **norms: Reader | tuple[Reader, ...]) -> Wiring:
    """A causal LM named as GPT2LMHeadModel: the token and position tables ``transformer.wte`` and
    ``transformer.wpe``, the blocks ``transformer.h.{layer}``, and ``transformer.ln_f`` read by
    ``lm_head``, tied to the token table."""
    return decoder("transformer.{wte|wpe}.weight", "transformer.h", "transformer.ln_f",
                   tied_to="transformer.wte.weight", writes=writes, conv1d=conv1d, **norms)


def bart_blocks(layers: str, *, cross_attention: bool = False, key_bias: bool = True) -> Wiring:
    """The BART lineage's pre-LN blocks ``{layers}.{layer}``: ``self_attn_layer_norm`` feeds
    ``self_attn``'s q/k/v_proj; with ``cross_attention``, ``encoder_attn_layer_norm`` feeds only
    ``encoder_attn.q_proj`` (keys and values read the encoder's output); ``final_layer_norm`` feeds
    ``fc1``. Every attention ``out_proj`` and ``fc2`` writes."""
    writes = "{self_attn.out_proj|encoder_attn.out_proj|fc2}" if cross_attention else "{self_attn.out_proj|fc2}"
    cross = {"encoder_attn_layer_norm": linear_reader("encoder_attn.q_proj")} if cross_attention else {}
    return pre_ln_blocks(layers, writes=writes, self_attn_layer_norm=attention_readers("self_attn", key_bias=key_bias),
                         **cross, final_layer_norm=linear_reader("fc1"))


def vit_encoder(stem: str, layers: str, *, tokens: str, key_bias: bool = True,
                norms: tuple[str, str] = ("layernorm_before", "layernorm_after")) -> Wiring:
    """ViT's encoder: the ``tokens`` of the embeddings module ``stem`` (the class token, the
    position table...: [1, n, d], hidden axis 2), its patch-embedding conv (weight [d, C, p, p] and
    bias [d], hidden axis 0), and the pre-LN blocks ``{layers}.{layer}``, whose first norm feeds
    the attention's q/k/v_proj and second ``mlp.fc1``; ``attention.o_proj`` and ``mlp.fc2`` write."""
    before, after = norms
    return join(Writer(f"{stem}.{tokens}", hidden_axis=2),
                Writer(f"{stem}.patch_embeddings.projection.{{weight|bias}}", hidden_axis=0),
                pre_ln_blocks(layers, writes="{attention.o_proj|mlp.fc2}",
                              **{before: attention_readers("attention", key_bias=key_bias),
                                 after: linear_reader("mlp.fc1")}))

