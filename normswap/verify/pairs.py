"""What a normswap checkpoint is verified against: which checkpoint, and which of its outputs.

A conversion, and a rotation of an original, are verified against the original. A rotation of a
``--fold-gains`` conversion was made from that conversion's stored weights, already rounded to
their dtype, and is verified against that conversion: no proof against the original can hold
for it (the original rotated in one float64 pass rounds once, the rotation of the folded
weights twice). That the folded conversion computes its original is its own verification.

A commuting rotation records the outputs that come out rotated, which are not compared: they must
be the ones its family's adapter names, or a tampered record could leave nothing to compare.
"""

from __future__ import annotations

from pathlib import Path

from normswap.architectures import Architecture
from normswap.checkpoint.provenance import Provenance, family_config
from normswap.errors import NormswapError


def check_reference(reference_dir: Path, reference_config: dict, checked_dir: Path,
                    provenance: Provenance | None) -> None:
    """Refuse, in one line, a reference that is not the one ``checked_dir`` is verified against
    (``provenance``: its checked block, None where it has none)."""
    if provenance is not None and provenance.rotated_from_conversion:
        if "normswap" not in reference_config:
            raise NormswapError(
                f"{checked_dir} was rotated from the normswap conversion {provenance.block['rotated_from']}, "
                f"not from {reference_dir}; verify it against that conversion (normswap verify FOLDED "
                f"{checked_dir}), and that conversion against {reference_dir}: the folded weights were rounded "
                "before the rotation, so no proof against the original holds")
        reference = Provenance.of(reference_config, reference_dir)
        if reference.rotation is not None or reference.slicing is not None or not reference.options.get("fold_gains"):
            raise NormswapError(f"{reference_dir} is not a --fold-gains conversion; {checked_dir} was rotated from "
                                f"{provenance.block['rotated_from']}: normswap verify FOLDED {checked_dir}")
        return
    if "normswap" in reference_config:
        swapped = " (the arguments look swapped)" if provenance is None else ""
        raise NormswapError(f"{reference_dir} is a converted checkpoint; verify takes the original first: "
                            f"normswap verify ORIGINAL CONVERTED{swapped}")


def uncompared_outputs(architecture: Architecture, reference_config: dict, rotation: dict, where: Path) -> frozenset:
    """The outputs a rotation leaves rotated (not compared), once the record is the adapter's."""
    recorded = rotation.get("rotated_outputs", {})
    expected = architecture.rotated_outputs(family_config(reference_config)) if rotation.get("form") == "commuting" \
        else {}
    if recorded != expected:
        raise NormswapError(f"{where / 'config.json'}: normswap.rotation.rotated_outputs is not what normswap records "
                            f"for this model ({', '.join(expected) or 'none'}); the record was changed")
    return frozenset(recorded)
