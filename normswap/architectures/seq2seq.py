"""The pre-LN text encoder-decoders of the BART lineage that transformers 5 builds alike:
M2M100/NLLB, mBART, Pegasus (``{Family}ForConditionalGeneration``).

Both stacks: ``self_attn_layer_norm`` → q/k/v_proj, ``final_layer_norm`` → ``fc1``; every
``out_proj`` and ``fc2`` writes. A decoder layer's ``encoder_attn_layer_norm`` is read only by
``encoder_attn.q_proj`` (keys and values read the encoder's final ``layer_norm``, whose output is
also ``encoder_last_hidden_state``, a model output: its gains stay). The shared token table writes
both streams (its scale √d commutes with centring); the head is tied to it and untied.

Positions differ: mBART's are learned tables (writers); M2M100's and Pegasus's are sinusoids
computed from the position (a buffer, or a frozen table transformers may rebuild), so the RMSNorm
class centres each stack's first-layer input explicitly (``centre_input``; the stock class needs
no such step). mBART's ``layernorm_embedding`` normalises the embeddings: its output *is* the
stream, so the RMSNorm class centres that output (``centre_output``, as CLIP's ``pre_layrnorm``).
"""

from __future__ import annotations

from normswap.architectures.layouts import bart_blocks
from normswap.architectures.spec import (
    CENTRE_INPUT,
    CENTRE_OUTPUT,
    Architecture,
    Norm,
    assemble,
    embeddings,
    lm_head,
    only_classes,
    pattern,
)

M = "{base=model.|}"


def encoder_decoder(model_type: str, class_name: str, *, learned_positions: bool,
                    embedding_norm: bool) -> Architecture:
    """The adapter of one family: where its positions come from, whether it norms the embeddings."""
    tables = "{shared|encoder.embed_tokens|decoder.embed_tokens" + ("|encoder.embed_positions|decoder.embed_positions"
                                                                     if learned_positions else "") + "}"
    structure = {CENTRE_OUTPUT: [pattern("model.{encoder|decoder}.layernorm_embedding")]} if embedding_norm else {}
    if not learned_positions:
        structure[CENTRE_INPUT] = [pattern("model.{encoder|decoder}.layers.0")]
    return assemble(
        model_type, "AutoModelForSeq2SeqLM",
        embeddings(f"model.{tables}.weight"),
        # its output is the stream: no reader to fold into; centred in the RMSNorm class
        Norm(M + "{encoder|decoder}.layernorm_embedding"),
        bart_blocks(M + "encoder.layers"),
        Norm(M + "encoder.layer_norm", output_is_model_output=True),
        bart_blocks(M + "decoder.layers", cross_attention=True),
        lm_head(M + "decoder.layer_norm", tied_to="model.shared.weight"),
        refuse=only_classes(class_name),
        structure=lambda config: structure,
        shared=tuple((f"model.{stack}.embed_tokens.weight", "model.shared.weight") for stack in ("encoder", "decoder")),
        probe="seq2seq_text",
        blocks="model.decoder.layers",
    )
