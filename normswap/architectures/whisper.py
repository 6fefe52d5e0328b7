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

Only ``WhisperForConditionalGeneration`` checkpoints are accepted (the hub's Whisper models); the
encoder-only and decoder-only classes read these norms differently.
"""

from normswap.architectures.spec import (
    LINEAR_IN_AXIS,
    LINEAR_OUT_AXIS,
    Architecture,
    Norm,
    Reader,
    Writer,
    only_classes,
)

M = r"(?P<m>(model\.)?)"
ENC = M + r"encoder\.layers\.(?P<layer>\d+)"
DEC = M + r"decoder\.layers\.(?P<layer>\d+)"
SUPPORTED_CLASSES = ("WhisperForConditionalGeneration",)


def _attention(stack: str, attention: str) -> tuple[Reader, ...]:
    prefix = "{m}" + stack + ".layers.{layer}." + attention
    return (
        Reader(prefix + ".q_proj.weight", LINEAR_IN_AXIS, prefix + ".q_proj.bias"),
        Reader(prefix + ".k_proj.weight", LINEAR_IN_AXIS, None, constant_cancels=True),
        Reader(prefix + ".v_proj.weight", LINEAR_IN_AXIS, prefix + ".v_proj.bias"),
    )


def _mlp(stack: str) -> tuple[Reader, ...]:
    prefix = "{m}" + stack + ".layers.{layer}.fc1"
    return (Reader(prefix + ".weight", LINEAR_IN_AXIS, prefix + ".bias"),)



WHISPER = Architecture(
    model_types=("whisper",),
    auto_class="AutoModelForSpeechSeq2Seq",
    writers=(
        Writer(M + r"decoder\.embed_tokens\.weight", hidden_axis=1),
        Writer(M + r"decoder\.embed_positions\.weight", hidden_axis=1),
        Writer(M + r"(en|de)coder\.layers\.\d+\.(self_attn|encoder_attn)\.out_proj\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(M + r"(en|de)coder\.layers\.\d+\.(self_attn|encoder_attn)\.out_proj\.bias", hidden_axis=0),
        Writer(M + r"(en|de)coder\.layers\.\d+\.fc2\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(M + r"(en|de)coder\.layers\.\d+\.fc2\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(ENC + r"\.self_attn_layer_norm", _attention("encoder", "self_attn")),
        Norm(ENC + r"\.final_layer_norm", _mlp("encoder")),
        # read by k_proj/v_proj of every decoder layer's encoder_attn, and returned to the user
        Norm(M + r"encoder\.layer_norm", output_is_model_output=True),
        Norm(DEC + r"\.self_attn_layer_norm", _attention("decoder", "self_attn")),
        Norm(DEC + r"\.encoder_attn_layer_norm", (
            Reader("{m}decoder.layers.{layer}.encoder_attn.q_proj.weight", LINEAR_IN_AXIS,
                   "{m}decoder.layers.{layer}.encoder_attn.q_proj.bias"),
        )),
        Norm(DEC + r"\.final_layer_norm", _mlp("decoder")),
        Norm(M + r"decoder\.layer_norm", (Reader("proj_out.weight", LINEAR_IN_AXIS),)),
    ),
    tied=(("proj_out.weight", "model.decoder.embed_tokens.weight"),),
    refuse=only_classes(*SUPPORTED_CLASSES),
    # the encoder stream starts as gelu(conv(...)) + positions: centre it once, explicitly
    structure=lambda config: {"centre_input": [r"(model\.)?encoder\.layers\.0"]},
    probe="seq2seq_speech",
    notes="encoder input centred explicitly in the RMSNorm class; encoder final norm kept (model output)",
)
