"""The declarative description of an architecture that the generic surgery works from.

An adapter says, with regular expressions over state-dict names, which tensors *write* the
residual stream (and along which axis the hidden dimension runs), which norms exist and which
tensors *read* each norm's output, and how the head is tied. It holds no tensor math: that is in
``normswap.fold``, shared by every family.

Patterns match whole *canonical* names: the names in the state dict of the family's model class
(``transformer.h.0.ln_1.weight``). Checkpoints saved from the base model (``h.0.ln_1.weight``)
are renamed to canonical names when they are read, so adapters never deal with prefixes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

# The Conv1D of GPT-2-style models stores weights as [in, out]; nn.Linear stores [out, in].
LINEAR_OUT_AXIS, LINEAR_IN_AXIS = 0, 1
CONV1D_IN_AXIS, CONV1D_OUT_AXIS = 0, 1


@dataclass(frozen=True)
class Writer:
    """Tensors that add into the residual stream: the stream's dimension is ``hidden_axis``.

    Centring along that axis (subtracting the mean over it) makes every write orthogonal to 1.
    """

    pattern: str
    hidden_axis: int


@dataclass(frozen=True)
class Reader:
    """A layer that reads a norm's output: y = W·n + b, with n indexed by ``input_axis`` of W.

    ``weight`` and ``bias`` are templates filled with the named groups of the norm's pattern,
    e.g. ``"h.{layer}.attn.c_attn.weight"``. ``bias`` is None when the layer has no bias slot.

    ``constant_cancels``: a constant added to this layer's output has no effect downstream, so
    the term Wβ may be dropped when the layer has no bias slot. Attention keys are the case:
    score_ij = q_i·(k_j + c) = q_i·k_j + q_i·c shifts every score of query i by the same amount,
    and softmax over j is invariant to that (masked scores stay masked).
    """

    weight: str
    input_axis: int
    bias: str | None = None
    constant_cancels: bool = False


@dataclass(frozen=True)
class Norm:
    """A LayerNorm, named by a pattern for its module prefix, and the layers that read it.

    ``output_is_model_output``: the norm's output is itself returned to the user (an encoder's
    ``last_hidden_state``), so its gains must stay in the norm and are never folded.
    """

    pattern: str
    readers: tuple[Reader, ...] = ()
    output_is_model_output: bool = False


@dataclass(frozen=True)
class EmbeddingNormBake:
    """A norm applied to an embedding lookup (BLOOM): LN(E[i]) is a table, so bake it per row."""

    embedding: str
    norm: str  # module prefix of the norm (its ``.weight`` and ``.bias`` are read)


@dataclass(frozen=True)
class Architecture:
    """Everything the surgery needs to know about one model family."""

    model_types: tuple[str, ...]
    auto_class: str
    writers: tuple[Writer, ...]
    norms: tuple[Norm, ...]
    # (head weight, embedding weight) pairs that may be tied
    tied: tuple[tuple[str, str], ...] = ()
    # a function config -> reason string when the checkpoint cannot be converted exactly
    refuse: Callable[[dict], str | None] = lambda config: None
    # config keys -> values that say the head is tied (default: tie_word_embeddings, true if absent)
    tie_flag: str = "tie_word_embeddings"
    # tensors dropped from the output: buffers that the current classes no longer keep
    ignore: tuple[str, ...] = ()
    bake: tuple[EmbeddingNormBake, ...] = ()
    # structural changes for the RMSNorm class (see modeling/remote.py), as config -> dict
    structure: Callable[[dict], dict[str, list[str]]] = lambda config: {}
    # how verification builds inputs: "causal_lm", "seq2seq_speech", "vision", "clip"
    probe: str = "causal_lm"
    # attribute path of the ModuleList of residual blocks ("transformer.h"), for layer-by-layer
    # verification; None: the longest list of same-class modules is taken (see verify_layerwise)
    blocks: str | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # config -> replacements for the fields above, for families whose wiring depends on the config
    # (OPT's project_in/project_out, Falcon's parallel block); see ``for_config``
    variant: Callable[[dict], dict[str, Any]] = lambda config: {}

    def for_config(self, config: dict) -> Architecture:
        """This adapter as it applies to one checkpoint's config: ``variant``'s fields replaced.

        A variant only swaps declarative fields (which tensors write, which layers read a norm);
        the surgery stays the same for every variant.
        """
        changes = self.variant(config)
        return replace(self, **changes) if changes else self


def full_match(pattern: str, name: str) -> re.Match[str] | None:
    """Match ``pattern`` against a whole canonical state-dict name."""
    return re.fullmatch(pattern, name)


def only_classes(*supported: str) -> Callable[[dict], str | None]:
    """A ``refuse`` that accepts checkpoints of the given model classes only.

    For families whose classes read the final norm differently (a pooled head, a classifier on
    the class token), where the adapter describes only some of them.
    """

    def refuse(config: dict) -> str | None:
        classes = config.get("architectures") or list(supported)
        if not set(classes) & set(supported):
            return (f"only {', '.join(supported)} checkpoints are supported (this one is "
                    f"{', '.join(classes)}), whose norms are read as the adapter describes")
        return None

    return refuse
