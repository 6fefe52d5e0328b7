"""What a plan does, as data: ``Step``s to one tensor (a ``TensorPlan`` lists them), what happens
to one norm (``NormPlan``), and the ``Structure`` it changes in the model class.
``normswap.convert.plan`` decides them; ``normswap.convert.fold`` executes the steps
(``compute_tensor``, ``slice_kernel``), each step's math being a ``fold`` function.

A ``SliceStep`` acts independently on every slice taken across its ``axis`` (the axis that
indexes the hidden dimension), so it can run in float64 slices of a large tensor, in place; a
``WholeStep`` needs the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from normswap.checkpoint.safetensors_io import StoredTensor
from normswap.dtypes import dtype_name
from normswap.errors import NormswapError


class SliceStep:
    slice_wise = True


class WholeStep:
    slice_wise = False


@dataclass(frozen=True)
class Bake(SliceStep):
    """Replace each row e by LayerNorm(e) with the given norm's γ, β and eps."""

    gain: str
    bias: str
    eps: float
    axis: int


@dataclass(frozen=True)
class Centre(SliceStep):
    """Subtract the mean along ``axis``: w ← w - mean(w), which applies C = I - 11ᵀ/d along the
    hidden dimension (``fold.centre``)."""

    axis: int


@dataclass(frozen=True)
class FoldGain(SliceStep):
    """Multiply ``axis`` by the gain ``gain`` + ``offset``: a reader's input axis by its norm's γ
    (``offset`` 1 for a norm that stores γ - 1), or a writer's output axis by its LayerScale."""

    gain: str
    axis: int
    offset: float = 0.0


@dataclass(frozen=True)
class CentreHeads(WholeStep):
    """Centre each head's block of ``head_dim`` entries along ``axis`` (``fold.centre_heads``):
    of every ``period`` consecutive blocks, those at the positions in ``members`` (a fused q/k/v
    projection centres its q and k blocks, not v)."""

    axis: int
    head_dim: int
    period: int = 1
    members: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class FoldBias(WholeStep):
    """Reader bias b ← b + Wβ, with W the original reader weight ``weight`` read along ``axis``."""

    weight: str
    norm_bias: str
    axis: int


@dataclass(frozen=True)
class DivideByGain(WholeStep):
    """Norm bias β ← β ⊘ (γ + ``offset``), for a norm whose γ is folded but whose β has nowhere to go."""

    gain: str
    offset: float = 0.0


@dataclass(frozen=True)
class Fill(WholeStep):
    """Replace the values by a constant."""

    value: float  # 1.0 for a folded norm's gain, 0.0 for its folded bias


@dataclass(frozen=True, eq=False)
class Rotate:
    """Contract the stream axis ``axis`` with the orthogonal Q of ``rotation`` (``fold.rotate_axis``).

    ``side`` says which of ``fold.rotate_axis``'s identities this is (writer, reader, norm_bias).
    Slice-wise: every slice across ``axis`` is rotated on its own. A norm bias is rotated after
    its β ⊘ γ is formed, so that step is whole-tensor (``slice_wise`` False) and keeps its order.
    """

    axis: int
    side: str
    rotation: object = field(repr=False)  # normswap.rotate.pipeline.Rotation: the matrix and its label
    slice_wise: bool = True


Step = Bake | Centre | CentreHeads | FoldGain | FoldBias | DivideByGain | Fill | Rotate


@dataclass
class Structure:
    """The structural changes the RMSNorm class performs, by module path of the model class.

    Stored as ``config.normswap.structure`` (``to_json``: the non-empty kinds, keyed by these
    field names), which ``normswap.modeling.remote.apply_structure`` reads; that file is copied
    into every checkpoint and imports nothing from normswap, so it spells the keys itself (a test
    keeps the two in step).
    """

    identity: list[str] = field(default_factory=list)  # replaced by nn.Identity (a baked norm)
    centre_input: list[str] = field(default_factory=list)  # first input centred explicitly
    centre_output: list[str] = field(default_factory=list)  # output centred explicitly
    gain_plus_one: list[str] = field(default_factory=list)  # norms that store γ - 1

    @classmethod
    def from_json(cls, data: dict[str, list[str]] | None) -> Structure:
        """From an adapter's ``structure(config)`` or a checkpoint's ``normswap.structure``."""
        kinds = {f.name for f in fields(cls)}
        for kind in data or {}:
            if kind not in kinds:
                raise NormswapError(f"unknown structural change '{kind}'; normswap knows {', '.join(sorted(kinds))}")
        return cls(**{kind: list(paths) for kind, paths in (data or {}).items()})

    def to_json(self) -> dict[str, list[str]]:
        return {f.name: list(paths) for f in fields(self) if (paths := getattr(self, f.name))}

    @property
    def centres(self) -> bool:
        """Whether part of the stream is centred at run time (which no rotation commutes with)."""
        return bool(self.centre_input or self.centre_output)

    def __bool__(self) -> bool:
        return bool(self.to_json())

    def __str__(self) -> str:
        return str(self.to_json())


@dataclass
class TensorPlan(StoredTensor):
    """How one output tensor is made. Its dtype is kept by name (a ``torch.dtype`` given is stored
    as its name); ``dtype`` is the ``torch.dtype``."""

    name: str
    source: str | None  # source tensor the value starts from; None for a bias created from zeros
    shape: tuple[int, ...]
    dtype_name: str
    shard: str
    steps: list[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dtype_name = dtype_name(self.dtype_name)


@dataclass
class NormPlan:
    """What happens to one norm: always swapped; optionally its γ/β folded into its readers."""

    name: str
    readers: list[str]
    folded_gain: bool = False
    folded_bias: bool = False
    kept_bias: str | None = None  # "β" or "β/γ" when the norm keeps a bias
    baked_into: str | None = None
    note: str = ""
    per_head: bool = False  # a per-head norm of queries or keys (its projection is centred per head)
