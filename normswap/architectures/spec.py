"""The declarative description of an architecture that the generic surgery works from.

An adapter says which tensors *write* the residual stream (and along which axis the hidden
dimension runs), which norms exist and which tensors *read* each norm's output, and how the head
is tied. It holds no tensor math: that is in ``normswap.convert.fold``, shared by every family.

Names are templates of whole *canonical* names, those of the family's model class's state dict
(``transformer.h.{layer}.ln_1``); checkpoints saved from the base model are renamed on reading.
In a template

* ``{layer}`` is a layer index, ``{head}`` a head index (a ModuleList of per-head norms);
* ``{a|b}`` is one of the alternatives (``transformer.{wte|wpe}.weight``);
* ``{name=a|b|}`` is a named choice (here ``a``, ``b`` or nothing): a prefix under which some of
  a family's classes nest the same modules (CLIP's ``{tower=text_model.|vision_model.|}``).
  Readers' templates repeat it and take the value it has in the norm they read.

``pattern`` compiles a template to a regular expression; a norm's named groups fill its readers'.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from normswap.architectures.facts import FactsByClass, ModelFacts, declared_facts

# The Conv1D of GPT-2-style models stores weights as [in, out]; nn.Linear stores [out, in].
LINEAR_OUT_AXIS, LINEAR_IN_AXIS = 0, 1
CONV1D_IN_AXIS, CONV1D_OUT_AXIS = 0, 1

# Keys of a plan's ``structure``, as ``config.normswap.structure`` stores them: the structural
# changes the RMSNorm class performs. ``normswap.modeling.remote.apply_structure`` reads them (it
# is copied into every checkpoint and imports nothing from normswap, so it spells them itself; a
# test keeps the two in step). ``identity``: modules replaced by nn.Identity (added by the plan for
# a baked norm); ``centre_input``/``centre_output``: modules whose input/output is centred;
# ``gain_plus_one``: norms that store γ - 1 (added by the plan for a norm with ``gain_offset`` 1).
IDENTITY, CENTRE_INPUT, CENTRE_OUTPUT, GAIN_PLUS_ONE = "identity", "centre_input", "centre_output", "gain_plus_one"
STRUCTURE_KINDS = (IDENTITY, CENTRE_INPUT, CENTRE_OUTPUT, GAIN_PLUS_ONE)

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


@functools.cache
def pattern(template: str) -> str:
    """The regular expression that matches the whole names ``template`` stands for."""
    parts, end = [], 0
    for match in _PLACEHOLDER.finditer(template):
        parts.append(re.escape(template[end:match.start()]))
        name, is_named, choices = match.group(1).rpartition("=")
        if choices in ("layer", "head") and not is_named:
            parts.append(rf"(?P<{choices}>\d+)")
        elif is_named:
            parts.append(f"(?P<{name}>" + "|".join(map(re.escape, choices.split("|"))) + ")")
        elif "|" in choices:
            parts.append("(" + "|".join(map(re.escape, choices.split("|"))) + ")")
        else:
            raise ValueError(f"unknown placeholder {match.group(0)} in name template {template!r}")
        end = match.end()
    parts.append(re.escape(template[end:]))
    return "".join(parts)


def format_template(template: str) -> str:
    """``template`` as a ``str.format`` string filled from a norm's named groups."""

    def field(match: re.Match[str]) -> str:
        name, is_named, choices = match.group(1).rpartition("=")
        if "|" in choices and not is_named:
            raise ValueError(f"a reader names one tensor; {template!r} has alternatives")
        return "{" + (name if is_named else choices) + "}"

    return _PLACEHOLDER.sub(field, template)


@dataclass(frozen=True)
class Writer:
    """Tensors that add into the residual stream: the stream's dimension is ``hidden_axis``.

    Centring along that axis (subtracting the mean over it) makes every write orthogonal to 1.
    """

    name: str  # template of the tensor names
    hidden_axis: int

    @property
    def pattern(self) -> str:
        return pattern(self.name)


@dataclass(frozen=True)
class Reader:
    """A layer that reads a norm's output: y = W·n + b, with n indexed by ``input_axis`` of W.

    ``module`` is the layer's template (``transformer.h.{layer}.attn.c_attn``), filled with the
    named groups of the norm's pattern. ``has_bias``: the layer has a bias slot.

    ``constant_cancels``: a constant added to this layer's output has no effect downstream, so
    the term Wβ may be dropped when the layer has no bias slot. Attention keys are the case:
    score_ij = q_i·(k_j + c) = q_i·k_j + q_i·c shifts every score of query i by the same amount,
    and softmax over j is invariant to that (masked scores stay masked).
    """

    module: str
    input_axis: int
    has_bias: bool = True
    constant_cancels: bool = False

    @property
    def weight(self) -> str:
        """The weight's name as a ``str.format`` template."""
        return format_template(self.module) + ".weight"

    @property
    def bias(self) -> str | None:
        """The bias's name as a ``str.format`` template; None when the layer has no bias slot."""
        return format_template(self.module) + ".bias" if self.has_bias else None


@dataclass(frozen=True)
class Norm:
    """A LayerNorm, named by a template of its module path, and the layers that read it.

    ``output_is_model_output``: the norm's output is itself returned to the user (an encoder's
    ``last_hidden_state``), so its gains must stay in the norm and are never folded.
    ``gain_offset``: γ = stored weight + offset (1 for Nemotron's LayerNorm1P, which stores γ - 1).
    """

    module: str
    readers: tuple[Reader, ...] = ()
    output_is_model_output: bool = False
    gain_offset: float = 0.0

    @property
    def pattern(self) -> str:
        return pattern(self.module)


@dataclass(frozen=True)
class HeadNorm:
    """A per-head LayerNorm of queries or keys: ``module`` normalises each head's slice of the
    output of ``projection`` (a module template, centred per head along its output ``axis``);
    the head size is the norm's last dimension.

    Centring the projection's rows per head (``fold.centre_heads``) makes its input zero-mean: an
    RMSNorm, gains kept. A fused q/k/v output has ``period`` blocks per head, ``members`` normed.
    """

    module: str
    projection: str
    axis: int = 0
    period: int = 1
    members: tuple[int, ...] = (0,)

    @property
    def pattern(self) -> str:
        return pattern(self.module)


@dataclass(frozen=True)
class LayerScale:
    """A per-channel scale λ on a writer's output (DINOv2, BEiT): the stream gets λ ⊙ (W·u + b).

    ``scale`` names λ, ``writer`` the Linear it scales: W' = C·diag(λ)·W, b' = C(λ ⊙ b), λ ← 1.
    """

    scale: str
    writer: str


def linear_writers(module: str, *, conv1d: bool = False) -> tuple[Writer, Writer]:
    """The weight and bias of a Linear (or GPT-2 Conv1D) layer whose output adds into the stream."""
    out_axis = CONV1D_OUT_AXIS if conv1d else LINEAR_OUT_AXIS
    return Writer(f"{module}.weight", out_axis), Writer(f"{module}.bias", 0)


def linear_reader(module: str, *, bias: bool = True, constant_cancels: bool = False) -> Reader:
    """An nn.Linear reading a norm's output (weight [out, in]), with or without a bias slot."""
    return Reader(module, LINEAR_IN_AXIS, bias, constant_cancels)


def conv1d_reader(module: str) -> Reader:
    """A GPT-2 Conv1D (weight [in, out], with a bias) reading a norm's output."""
    return Reader(module, CONV1D_IN_AXIS)


def attention_readers(attention: str, *, bias: bool = True, key_bias: bool | None = None,
                      rotary: bool = False) -> tuple[Reader, Reader, Reader]:
    """``q_proj``, ``k_proj`` and ``v_proj`` of an ``attention`` module reading a norm's output;
    ``bias`` says whether they have bias slots, ``key_bias`` (if given) whether ``k_proj`` has one.

    Keys are marked ``constant_cancels``: the softmax cancels a constant added to every key. Not
    with ``rotary`` positions, which turn that constant by position before the scores see it.
    """
    return (
        linear_reader(f"{attention}.q_proj", bias=bias),
        linear_reader(f"{attention}.k_proj", bias=bias if key_bias is None else key_bias, constant_cancels=not rotary),
        linear_reader(f"{attention}.v_proj", bias=bias),
    )


@dataclass(frozen=True)
class Wiring:
    """A piece of a model's residual stream: the tensors that write it, its norms with the layers
    that read them, and the (head, table) pairs that may be tied. ``assemble`` joins pieces, in
    the order of the architecture diagram, into an ``Architecture``."""

    writers: tuple[Writer, ...] = ()
    norms: tuple[Norm, ...] = ()
    tied: tuple[tuple[str, str], ...] = ()


def embeddings(tables: str, *, hidden_axis: int = 1) -> Wiring:
    """Tables (token, position) whose rows are added into the stream; rows are [vocab, hidden]."""
    return Wiring(writers=(Writer(tables, hidden_axis),))


def pre_ln_blocks(layers: str, *, writes: str, conv1d: bool = False, **norms: Reader | tuple[Reader, ...]) -> Wiring:
    """The stack of residual blocks ``{layers}.{layer}``: each keyword names a norm of the block and
    the layers that read it; ``writes`` names the layers whose output adds back into the stream.

    Names are relative to the block, as in the block's diagram::

        pre_ln_blocks("transformer.h", writes="{attn|mlp}.c_proj", conv1d=True,
                      ln_1=conv1d_reader("attn.c_attn"), ln_2=conv1d_reader("mlp.c_fc"))
    """
    block = layers + ".{layer}"

    def read_by(readers: Reader | tuple[Reader, ...]) -> tuple[Reader, ...]:
        readers = readers if isinstance(readers, tuple) else (readers,)
        return tuple(replace(reader, module=f"{block}.{reader.module}") for reader in readers)

    return Wiring(
        writers=linear_writers(f"{block}.{writes}", conv1d=conv1d),
        norms=tuple(Norm(f"{block}.{name}", read_by(readers)) for name, readers in norms.items()),
    )


def lm_head(final_norm: str, *, head: str = "lm_head", bias: bool = False, tied_to: str | None = None) -> Wiring:
    """The final norm, read by the output head (a Linear, ``bias`` saying whether it has a bias
    slot), whose weight may be tied to the token table ``tied_to``."""
    return Wiring(norms=(Norm(final_norm, (linear_reader(head, bias=bias),)),),
                  tied=((f"{head}.weight", tied_to),) if tied_to else ())


def join(*parts: Wiring | Writer | Norm) -> Wiring:
    """The piece whose writers, norms and tied pairs are those of ``parts`` in order (a bare
    ``Writer`` or ``Norm`` is a part of its own)."""
    pieces = [Wiring(writers=(part,)) if isinstance(part, Writer) else Wiring(norms=(part,))
              if isinstance(part, Norm) else part for part in parts]
    return Wiring(writers=tuple(writer for piece in pieces for writer in piece.writers),
                  norms=tuple(norm for piece in pieces for norm in piece.norms),
                  tied=tuple(pair for piece in pieces for pair in piece.tied))


def assemble(model_types: str | tuple[str, ...], auto_class: str, *parts: Wiring | Writer | Norm,
             **fields: Any) -> Architecture:
    """The ``Architecture`` made of ``parts`` in order (see ``join``); ``fields`` sets the others."""
    whole = join(*parts)
    model_types = (model_types,) if isinstance(model_types, str) else model_types
    return Architecture(model_types=model_types, auto_class=auto_class, writers=whole.writers,
                        norms=whole.norms, tied=whole.tied, **fields)


@dataclass(frozen=True)
class EmbeddingNormBake:
    """A norm applied to an embedding lookup (BLOOM): LN(E[i]) is a table, so bake it per row."""

    embedding: str
    norm: str  # module prefix of the norm (its ``.weight`` and ``.bias`` are read)


@dataclass(frozen=True)
class SliceLayout:
    """Where a family's residual adds are, for slicing (``normswap.rotate.slicing``): the blocks,
    each block's (norm, branch) pairs in order, the final norm, the tensors that write the first
    signal (hidden axis 1) and the config key of the norms' epsilon."""

    blocks: str
    branches: tuple[tuple[str, str], ...]
    final_norm: str
    embeddings: tuple[str, ...]
    eps_key: str


GPT2_SLICE_LAYOUT = SliceLayout("transformer.h", (("ln_1", "attn"), ("ln_2", "mlp")), "transformer.ln_f",
                                ("transformer.wte.weight", "transformer.wpe.weight"), "layer_norm_epsilon")
MODALITIES = ("text", "audio", "images")


@dataclass(frozen=True)
class Architecture:
    """Everything normswap needs to know about one model family: the one record of it."""

    model_types: tuple[str, ...]
    auto_class: str
    writers: tuple[Writer, ...]
    norms: tuple[Norm, ...]
    tied: tuple[tuple[str, str], ...] = ()  # (head weight, embedding weight) pairs that may be tied
    # (copy, table) pairs sharing one table (token tables), tied by the head's flag: written untied
    shared: tuple[tuple[str, str], ...] = ()
    # a function config -> reason string when the checkpoint cannot be converted exactly
    refuse: Callable[[dict], str | None] = lambda config: None
    # config keys -> values that say the head is tied (default: tie_word_embeddings, true if absent)
    tie_flag: str = "tie_word_embeddings"
    # the value the config class gives ``tie_flag`` when config.json omits it (None: ask it)
    tie_default: bool | None = None
    # tensors dropped from the output: buffers that the current classes no longer keep (regular
    # expressions, compiled from templates with ``pattern``)
    ignore: tuple[str, ...] = ()
    bake: tuple[EmbeddingNormBake, ...] = ()
    head_norms: tuple[HeadNorm, ...] = ()
    layer_scales: tuple[LayerScale, ...] = ()
    # structural changes for the RMSNorm class, as config -> {kind: module patterns}, a kind being
    # one of STRUCTURE_KINDS (``centre_input``, ``centre_output``; the plan adds ``identity``)
    structure: Callable[[dict], dict[str, list[str]]] = lambda config: {}
    # how verification builds inputs: "causal_lm", "seq2seq_speech", "vision", "clip"
    probe: str = "causal_lm"
    # attribute path of the ModuleList of residual blocks ("transformer.h"), for layer-by-layer
    # verification; None: the longest list of same-class modules is taken (see verify_layerwise)
    blocks: str | None = None
    # config -> replacements for the fields above, for families whose wiring depends on the config
    # (OPT's project_in/project_out, Falcon's parallel block); see ``for_config``
    variant: Callable[[dict], dict[str, Any]] = lambda config: {}
    # the model classes' facts planning needs, declared per class name as config -> ModelFacts
    # (``normswap.architectures.facts``), and the class the family's Auto class builds; a class
    # not declared is built on the meta device instead
    classes: FactsByClass = field(default_factory=dict)
    default_class: str | None = None
    # the commuting rotation (Q·1 = 1, stock LayerNorm kept): streams the stock class cannot hold
    # rotated, as config -> {regular expression of a name prefix: why}; their tensors stay as they are
    fixed_streams: Callable[[dict], dict[str, str]] = lambda config: {}
    # the commuting rotation: the model outputs that come out rotated, as config -> {attribute path
    # of the output object (``text_model_output.pooler_output``): the norm whose output it is}
    rotated_outputs: Callable[[dict], dict[str, str]] = lambda config: {}
    # what evaluation and calibration feed the model (one of MODALITIES), for every model type of
    # the family or per model type (a type not named reads text)
    modality: str | dict[str, str] = "text"
    # the block layout slicing works from; None: the family is not sliced
    slice_layout: SliceLayout | None = None
    # lm-eval's requests may run with one cached forward per shared context
    # (``normswap.evaluation.shared_context``): its left-padded, position-explicit cached forward is
    # tested against HFLM's path for this family
    shared_context: bool = False
    # model types whose rotation covers one tower only, as {model type: attribute of that tower}
    # (CLIPModel's text_model): their calibration forward runs that tower alone, on text
    calibration_tower: dict[str, str] = field(default_factory=dict)

    def modality_of(self, model_type: str) -> str:
        """What a checkpoint of ``model_type`` (one of this family's) reads."""
        if isinstance(self.modality, dict):
            return self.modality.get(model_type, "text")
        return self.modality

    def calibration_modality(self, model_type: str) -> str:
        """What the rotated stream of a ``model_type`` checkpoint is calibrated on: the input of the
        tower it rotates, else the model's own."""
        return "text" if model_type in self.calibration_tower else self.modality_of(model_type)

    def facts(self, config: dict) -> ModelFacts | None:
        """The declared facts of the class ``config`` loads into; None when not declared."""
        return declared_facts(self.classes, self.default_class, config)

    def for_config(self, config: dict) -> Architecture:
        """This adapter as it applies to one checkpoint's config: ``variant``'s fields replaced.

        A variant only swaps declarative fields (which tensors write, which layers read a norm);
        the surgery stays the same for every variant.
        """
        changes = self.variant(config)
        return replace(self, **changes) if changes else self


def refuse_if(**reasons: str) -> Callable[[dict], str | None]:
    """A ``refuse`` for checkpoints whose config sets any of the given flags: ``flag=reason``."""

    def refuse(config: dict) -> str | None:
        return next((reason for flag, reason in reasons.items() if config.get(flag)), None)

    return refuse


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
