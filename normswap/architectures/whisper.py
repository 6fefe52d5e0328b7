"""Whisper: a pre-LN encoder-decoder (``WhisperForConditionalGeneration``).

Decoder: token and learned position embeddings write the stream and are centred as in GPT-2; the
head ``proj_out`` is tied to the decoder's ``embed_tokens`` and is untied (the head reads, it keeps
the original matrix). Every attention ``out_proj`` and MLP ``fc2`` writes, in both stacks.

Encoder: the stream starts as ``gelu(conv2(gelu(conv1(x)))) + positions``. A GELU output is not a
linear function of any weight, so no folding can make it zero-mean. The exact solution is one
explicit centring of the encoder input: structure ``centre_input`` on the first encoder layer
centres its ``hidden_states`` argument, h ← h - mean(h)·1. From there every write is centred, so
the whole encoder stream is centred and each encoder norm, swapped to RMSNorm, equals the original
LayerNorm. This costs one mean per encoder token per forward; the per-layer norms are still
dropped to RMSNorm. The stock LayerNorm class needs no such step and is exact without it: there
the stream keeps the constant-per-token mean of the GELU input, and every LayerNorm removes it,
LN(x + m·1) = LN(x).

Cross-attention: a decoder layer's ``encoder_attn_layer_norm`` is read only by ``q_proj``; keys
and values read the encoder's final ``layer_norm`` output, in every decoder layer. That output is
also the model's ``encoder_last_hidden_state`` (and what ``generate`` passes back to the decoder),
so its gains stay in the norm (``output_is_model_output``) and encoder outputs stay identical.

Attention ``k_proj`` has no bias: a norm's β folded through it would be a constant added to every
key, which softmax cancels (``constant_cancels``), so β folds into ``q_proj``/``v_proj`` only.
The decoder's final norm feeds ``proj_out``, which has no bias: γ folds, β/γ stays in the norm.

In short: the encoder input is centred explicitly in the RMSNorm class, and the encoder's final
norm keeps its gains (a model output).

Commuting rotation (Q·1 = 1, stock LayerNorm kept): the decoder stream is rotated; the encoder
stream is not (``fixed_streams``). Its first value is GELU(conv2(...)) + positions, and no tensor of
the stock class can turn GELU's output into GELU(·)·Q (only a permutation commutes with an
elementwise non-linearity), so the encoder, its final norm and the cross-attention k/v that read
that norm stay as they are.

Only ``WhisperForConditionalGeneration`` checkpoints are accepted (the hub's Whisper models); the
encoder-only and decoder-only classes read these norms differently.
"""

from __future__ import annotations

from normswap.architectures.facts import ModelFacts, StateDict, stated
from normswap.architectures.layouts import bart_blocks
from normswap.architectures.spec import (
    CENTRE_INPUT,
    Norm,
    assemble,
    embeddings,
    lm_head,
    only_classes,
    pattern,
)

M = "{base=model.|}"  # WhisperForConditionalGeneration nests the encoder-decoder under ``model.``
SUPPORTED_CLASSES = ("WhisperForConditionalGeneration",)
ENCODER_FIXED = ("the encoder stream starts as GELU(conv2(...)) + positions, and no stock tensor can rotate a GELU "
                 "output")


def _attention(state: StateDict, attention: str, d: int) -> None:
    state.linear(attention + ".k_proj", d, d, bias=False)
    for projection in ("v_proj", "q_proj", "out_proj"):
        state.linear(f"{attention}.{projection}", d, d)


def _facts(config: dict) -> ModelFacts:
    """WhisperForConditionalGeneration as WhisperEncoder and WhisperDecoder build it (every
    size must be stated: hub configs state them)."""
    d = stated(config, "d_model", size=True)
    state = StateDict("model")
    state.add("model.encoder.conv1", weight=(d, stated(config, "num_mel_bins", size=True), 3), bias=(d,))
    state.add("model.encoder.conv2", weight=(d, d, 3), bias=(d,))
    state.add("model.encoder.embed_positions", weight=(stated(config, "max_source_positions", size=True), d))
    for stack in ("encoder", "decoder"):
        if stack == "decoder":
            state.add("model.decoder.embed_tokens", weight=(stated(config, "vocab_size", size=True), d))
            state.add("model.decoder.embed_positions", weight=(stated(config, "max_target_positions", size=True), d))
        inner = stated(config, f"{stack}_ffn_dim", size=True)
        for layer in range(stated(config, f"{stack}_layers", size=True)):
            block = f"model.{stack}.layers.{layer}"
            _attention(state, block + ".self_attn", d)
            state.layer_norm(block + ".self_attn_layer_norm", d)
            if stack == "decoder":
                _attention(state, block + ".encoder_attn", d)
                state.layer_norm(block + ".encoder_attn_layer_norm", d)
            state.linear(block + ".fc1", d, inner).linear(block + ".fc2", inner, d).layer_norm(block + ".final_layer_norm", d)
        state.layer_norm(f"model.{stack}.layer_norm", d)
    return state.add("proj_out", weight=(stated(config, "vocab_size", size=True), d)).facts()


WHISPER = assemble(
    "whisper", "AutoModelForSpeechSeq2Seq",
    bart_blocks(M + "encoder.layers", key_bias=False),
    # read by k_proj/v_proj of every decoder layer's encoder_attn, and returned to the user
    Norm(M + "encoder.layer_norm", output_is_model_output=True),
    embeddings(M + "decoder.{embed_tokens|embed_positions}.weight"),
    bart_blocks(M + "decoder.layers", cross_attention=True, key_bias=False),
    lm_head(M + "decoder.layer_norm", head="proj_out", tied_to="model.decoder.embed_tokens.weight"),
    refuse=only_classes(*SUPPORTED_CLASSES),
    # the encoder stream starts as gelu(conv(...)) + positions: centre it once, explicitly
    structure=lambda config: {CENTRE_INPUT: [pattern("{model.|}encoder.layers.0")]},
    probe="seq2seq_speech",
    classes={"WhisperForConditionalGeneration": _facts},
    fixed_streams=lambda config: {pattern(M + "encoder."): ENCODER_FIXED},
    modality="audio",
)
