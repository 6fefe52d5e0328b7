"""The rotation methods and forms: one record per method, read by every place that names one.

A method says how the residual rotation Q is made; a form says what it is made for (``commuting``:
Q·1 = 1, so the stock LayerNorm stays and the output keeps its original model type; ``free``: any
orthogonal Q on the centred RMSNorm conversion). Each form's module holds one construction per
method, under the method's ``builder`` name: ``normswap.rotate.matrices`` for ``free``,
``normswap.rotate.commuting`` for ``commuting``. A seeded method's Q is a function of its order
and seed (the weights proof rebuilds it); a calibrated method's Q is measured on the model's kind
of input (its builder takes the stream's second moment) and is proven as stored.

Adding a method is one ``RotationMethod`` here plus its construction in each form's module. The
records sit below every command, free of torch, so that the provenance check, the rotate
pipeline, the weights proof and the CLI's choices read the same list at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RotationMethod:
    """How one kind of Q is made: ``seeded`` (a function of order and seed) or ``calibrated``
    (measured on calibration inputs); ``builder`` is the construction's name in each form's module."""

    name: str
    seeded: bool
    help: str  # what the rotate command's --method help says of it

    @property
    def calibrated(self) -> bool:
        return not self.seeded

    @property
    def builder(self) -> str:
        return f"{self.name}_rotation"


ROTATION_METHODS: dict[str, RotationMethod] = {
    method.name: method for method in (
        RotationMethod("hadamard", seeded=True, help="randomised Hadamard diag(±1)·H/√d (default)"),
        RotationMethod("orthogonal", seeded=True, help="seeded random orthogonal"),
        RotationMethod("pca", seeded=False, help="principal directions of the stream on --calibration inputs "
                                                 "(the default, and the only method, with --slice)"),
    )
}
DEFAULT_METHOD = "hadamard"
ROTATION_FORMS = ("commuting", "free")
DEFAULT_FORM = "commuting"
# at most this many calibration tokens are read (a calibrated method, and --slice)
DEFAULT_CALIBRATION_TOKENS = 32768


def rotation_method(name: object) -> RotationMethod | None:
    """The record of the method ``name``, or None when normswap has no such method."""
    return ROTATION_METHODS.get(name) if isinstance(name, str) else None
