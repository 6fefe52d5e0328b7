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

from normswap.architectures.spec import LINEAR_IN_AXIS, LINEAR_OUT_AXIS, Architecture, Norm, Reader, Writer

D = r"model\.decoder"
H = D + r"\.layers\.(?P<layer>\d+)"
L = "model.decoder.layers.{layer}"

_BLOCK_WRITERS = (
    Writer(D + r"\.embed_positions\.weight", hidden_axis=1),
    Writer(H + r"\.(self_attn\.out_proj|fc2)\.weight", hidden_axis=LINEAR_OUT_AXIS),
    Writer(H + r"\.(self_attn\.out_proj|fc2)\.bias", hidden_axis=0),
)
_BLOCK_NORMS = (
    Norm(H + r"\.self_attn_layer_norm", tuple(
        Reader(f"{L}.self_attn.{p}_proj.weight", LINEAR_IN_AXIS, f"{L}.self_attn.{p}_proj.bias") for p in "qkv"
    )),
    Norm(H + r"\.final_layer_norm", (Reader(f"{L}.fc1.weight", LINEAR_IN_AXIS, f"{L}.fc1.bias"),)),
)


def _projected(config: dict) -> bool:
    word_dim = config.get("word_embed_proj_dim")
    return word_dim is not None and word_dim != config.get("hidden_size")


def _variant(config: dict) -> dict:
    if not _projected(config):
        return {}
    return {
        "writers": (Writer(D + r"\.project_in\.weight", hidden_axis=LINEAR_OUT_AXIS), *_BLOCK_WRITERS),
        "norms": (*_BLOCK_NORMS, Norm(D + r"\.final_layer_norm", (
            Reader("model.decoder.project_out.weight", LINEAR_IN_AXIS),
        ))),
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
    writers=(Writer(D + r"\.embed_tokens\.weight", hidden_axis=1), *_BLOCK_WRITERS),
    norms=(*_BLOCK_NORMS, Norm(D + r"\.final_layer_norm", (Reader("lm_head.weight", LINEAR_IN_AXIS),))),
    tied=(("lm_head.weight", "model.decoder.embed_tokens.weight"),),
    refuse=_refuse,
    variant=_variant,
    blocks="model.decoder.layers",
)
