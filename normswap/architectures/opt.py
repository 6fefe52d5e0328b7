"""OPT: learned positions (offset 2), optional project_in/project_out, pre-LN or post-LN.

Pre-LN OPT (``do_layer_norm_before``, every size but 350m) converts exactly. Writers: the
position table (all rows, the two offset rows included), each ``self_attn.out_proj`` and ``fc2``,
and the token path. When ``word_embed_proj_dim == hidden_size`` the token table writes the
stream directly; otherwise tokens live in a smaller space and ``project_in`` writes them, so
``project_in`` is the writer and the token table is left alone (centring it would not commute
with the projection). Likewise the final norm is read by ``lm_head`` or, when projected, by
``project_out`` (no bias: β stays as β/γ), and ``lm_head`` then reads ``project_out``'s output.

Refused: ``do_layer_norm_before=False`` (OPT-350m) is post-LN: each norm's output *is* the new
residual stream; and a pre-LN model without its final norm (``_remove_final_layer_norm``),
whose head reads the raw stream, so centring the stream would change the logits.
"""

from __future__ import annotations

from normswap.architectures.facts import ModelFacts, StateDict, Unstated, sole_class, stated
from normswap.architectures.spec import (
    LINEAR_OUT_AXIS,
    Architecture,
    Norm,
    Writer,
    linear_reader,
    linear_writers,
)

D = "model.decoder"
H = D + ".layers.{layer}"

_BLOCK_WRITERS = (
    Writer(D + ".embed_positions.weight", hidden_axis=1),
    *linear_writers(H + ".{self_attn.out_proj|fc2}"),
)
_BLOCK_NORMS = (
    Norm(H + ".self_attn_layer_norm", tuple(linear_reader(f"{H}.self_attn.{p}_proj") for p in "qkv")),
    Norm(H + ".final_layer_norm", (linear_reader(H + ".fc1"),)),
)


def _projected(config: dict) -> bool:
    word_dim = config.get("word_embed_proj_dim")
    return word_dim is not None and word_dim != config.get("hidden_size")


def _variant(config: dict) -> dict:
    if not _projected(config):
        return {}
    return {
        "writers": (Writer(D + ".project_in.weight", hidden_axis=LINEAR_OUT_AXIS), *_BLOCK_WRITERS),
        "norms": (*_BLOCK_NORMS, Norm(D + ".final_layer_norm", (linear_reader(D + ".project_out", bias=False),))),
    }


def _refuse(config: dict) -> str | None:
    if not config.get("do_layer_norm_before", True):
        return ("do_layer_norm_before=False makes it a post-LN model (as OPT-350m): each LayerNorm's "
                "output becomes the residual stream, so mean removal cannot be moved into the weights")
    if config.get("_remove_final_layer_norm"):
        return ("the final LayerNorm was removed, so the head reads the raw residual stream and "
                "centring the stream would change the logits")
    return None



def _facts(config: dict) -> ModelFacts:
    """OPTForCausalLM as OPTDecoder builds it, for the pre-LN models the adapter converts."""
    d = stated(config, "hidden_size", 768, size=True)
    vocab = stated(config, "vocab_size", 50272, size=True)
    layers = stated(config, "num_hidden_layers", 12, size=True)
    positions = stated(config, "max_position_embeddings", 2048, size=True)
    inner = stated(config, "ffn_dim", 3072, size=True)
    words = stated(config, "word_embed_proj_dim", None) or d
    bias, affine = stated(config, "enable_bias", True), stated(config, "layer_norm_elementwise_affine", True)
    if not stated(config, "do_layer_norm_before", True) or stated(config, "_remove_final_layer_norm", False):
        raise Unstated("do_layer_norm_before")  # refused by the adapter
    state = StateDict("model").add(D + ".embed_tokens", weight=(vocab, words))
    state.add(D + ".embed_positions", weight=(positions + 2, d))  # OPT offsets positions by 2
    if words != d:
        state.linear(D + ".project_out", d, words, bias=False).linear(D + ".project_in", words, d, bias=False)
    state.layer_norm(D + ".final_layer_norm", d, affine=affine)
    for layer in range(layers):
        block = f"{D}.layers.{layer}"
        for projection in ("k_proj", "v_proj", "q_proj", "out_proj"):
            state.linear(f"{block}.self_attn.{projection}", d, d, bias=bias)
        state.layer_norm(block + ".self_attn_layer_norm", d, affine=affine)
        state.linear(block + ".fc1", d, inner, bias=bias).linear(block + ".fc2", inner, d, bias=bias)
        state.layer_norm(block + ".final_layer_norm", d, affine=affine)
    return state.add("lm_head", weight=(vocab, words)).facts()


OPT = Architecture(
    model_types=("opt",),
    auto_class="AutoModelForCausalLM",
    writers=(Writer(D + ".embed_tokens.weight", hidden_axis=1), *_BLOCK_WRITERS),
    norms=(*_BLOCK_NORMS, Norm(D + ".final_layer_norm", (linear_reader("lm_head", bias=False),))),
    tied=(("lm_head.weight", "model.decoder.embed_tokens.weight"),),
    refuse=_refuse,
    variant=_variant,
    blocks="model.decoder.layers",
    **sole_class("OPTForCausalLM", _facts),
    tie_default=True,
    shared_context=True,
)
