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


OPT = Architecture(
    model_types=("opt",),
    auto_class="AutoModelForCausalLM",
    writers=(Writer(D + ".embed_tokens.weight", hidden_axis=1), *_BLOCK_WRITERS),
    norms=(*_BLOCK_NORMS, Norm(D + ".final_layer_norm", (linear_reader("lm_head", bias=False),))),
    tied=(("lm_head.weight", "model.decoder.embed_tokens.weight"),),
    refuse=_refuse,
    variant=_variant,
    blocks="model.decoder.layers",
)
