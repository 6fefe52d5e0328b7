"""Provenance: the typed view of a normswap checkpoint's ``config["normswap"]`` block.

Every normswap checkpoint records how it was made in its config.json: the model type it was
converted from, the options, the structural changes its RMSNorm class performs, and for a rotated
or sliced checkpoint the rotation or slicing. ``Provenance.of`` checks the block once
(``validation.check_provenance``) and gives it typed; code that follows a checkpoint through a
command receives the parsed config and this view rather than reading config.json again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from normswap.checkpoint import validation


@dataclass(frozen=True)
class Provenance:
    """A checked ``normswap`` block: what a converted checkpoint was made from and how."""

    original_model_type: str | None
    options: dict = field(default_factory=dict)  # method, fold_gains, dtype
    structure: dict = field(default_factory=dict)  # Structure.to_json(): identity / centre_* module paths
    stock_loadable: bool = True
    modeling_sha256: str | None = None
    rotation: dict | None = None
    slicing: dict | None = None
    block: dict = field(default_factory=dict, repr=False)  # the block as written

    @classmethod
    def of(cls, config: dict, path: Path) -> Provenance | None:
        """The checked provenance of the checkpoint at ``path`` whose config is ``config``, or
        None for a checkpoint normswap did not write; a malformed block is a one-line refusal."""
        block = config.get("normswap")
        if block is None:
            return None
        validation.check_provenance(block, path)
        return cls(
            original_model_type=block.get("original_model_type", config.get("model_type")),
            options=block.get("options", {}), structure=block.get("structure", {}),
            stock_loadable=block.get("stock_loadable", True), modeling_sha256=block.get("modeling_sha256"),
            rotation=block.get("rotation"), slicing=block.get("slicing"), block=block,
        )

    @property
    def method(self) -> str:
        return self.options.get("method", "exact")

    @property
    def rmsnorm_exact(self) -> bool:
        """Whether the RMSNorm class computes the checkpoint: not for a commuting rotation of an
        uncentred stream (``rotation.centred`` false), which only the stock LayerNorm class computes."""
        return (self.rotation or {}).get("centred", True) is not False


def original_model_type(config: dict) -> str | None:
    """The model type a checkpoint's family is known by: the one it was converted from, for a
    normswap checkpoint (whose own type may be ``normswap_<type>``), else its own."""
    block = config.get("normswap")
    if isinstance(block, dict) and isinstance(block.get("original_model_type"), str):
        return block["original_model_type"]
    return config.get("model_type")


def family_config(config: dict) -> dict:
    """``config`` as its original family describes it: the model type restored (``original_model_type``)."""
    return {**config, "model_type": original_model_type(config)}
