"""The online Hadamard record, ``config.normswap.rotation.online_hadamard``: the one normswap makes
for a model (``spec_for``), and the check every reader runs before it builds or applies anything
from it (``check_record``: ``normswap.load``, eval's loaders, and verify's proof through
``rotate.online.check_spec``).

The record's size is bounded by the model first (it must be the MLP down projections' input size,
the order of a Kronecker split whose non-Sylvester factor F is at most ``MAX_FACTOR``) so that no
hostile order reaches a primality test or a matrix construction; only then is the record compared
with the one normswap makes. The checkpoint's own ``modeling_normswap.py`` checks what it can
without normswap (``remote.online_hadamard_factor``).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from normswap.errors import NormswapError
from normswap.modeling import hadamard
from normswap.modeling.build import meta_model

# the largest non-Sylvester factor F spelt into config.json (m² signs: 64 KiB at 256)
MAX_FACTOR = 256
# the MLP's down projection (its input is the MLP's hidden activation, which no residual rotation
# touches), per family naming
DOWN_PROJECTIONS = ("mlp.c_proj", "fc2", "dense_4h_to_h", "fc_out", "down_proj", "mlp.dense_4h_to_h")
RECORD = "normswap.rotation.online_hadamard"


def is_down_projection(name: str) -> bool:
    """Whether the linear layer ``name`` is an MLP's down projection (GPT-2's ``mlp.c_proj``, OPT's ``fc2``, ...)."""
    return any(name == suffix or name.endswith("." + suffix) for suffix in DOWN_PROJECTIONS)


def down_projection_modules(model: nn.Module) -> list[str]:
    """The module paths of the model's MLP down projections."""
    return [name for name, module in model.named_modules() if is_down_projection(name) and hasattr(module, "weight")]


def input_size(module: nn.Module) -> int:
    """A linear layer's input size: ``nn.Linear``'s in_features, transformers' Conv1D ``nx``."""
    return int(getattr(module, "in_features", None) or getattr(module, "nx", None) or module.weight.shape[-1])


def factor_order(size: int) -> int | None:
    """The order of F in H₂^⊗k ⊗ F for order ``size`` (``hadamard.kronecker_split``), or None where
    none is built here; a size over 2^24 or with an odd part over ``MAX_FACTOR`` is refused before
    ``construction`` runs (its primality tests), and F itself is never built."""
    odd = size
    while odd > 0 and odd % 2 == 0:
        odd //= 2
    if not 1 <= size <= 1 << 24 or odd > MAX_FACTOR:
        return None
    factors = hadamard.construction(size)
    if factors is None:
        return None
    twos = next((index for index, (kind, _) in enumerate(factors) if kind != "sylvester"), len(factors))
    return size >> twos


def spec_for(modules: list[str], size: int) -> dict:
    """The provenance record of an online Hadamard of order ``size`` at ``modules``."""
    twos, factor = hadamard.kronecker_split(size)
    return {"modules": modules, "size": size, "twos": twos, "construction": hadamard.describe(size),
            "factor": ["".join("+" if value > 0 else "-" for value in row) for row in factor.tolist()]}


def check_record(spec: object, model: nn.Module) -> None:
    """A recorded online Hadamard is the one normswap makes for ``model`` (a meta model will do),
    else one line. The size is checked against the model before anything is built from it."""
    if not isinstance(spec, dict) or type(spec.get("size")) is not int:
        raise NormswapError(f"{RECORD} must be a mapping with an integer size")
    modules = down_projection_modules(model)
    sizes = {input_size(model.get_submodule(path)) for path in modules}
    if sizes != {spec["size"]}:
        raise NormswapError(f"{RECORD}: its size is not the input size of the model's MLP down projections "
                            f"({', '.join(map(str, sorted(sizes))) or 'none'})")
    order = factor_order(spec["size"])
    if order is None or order > MAX_FACTOR or spec != spec_for(modules, spec["size"]):
        raise NormswapError(f"{RECORD} is not the online Hadamard normswap makes for this model (its modules, "
                            "order or factor differ)")


def check_config(config: dict, auto_class: str, path: Path) -> None:
    """``check_record`` for the record in ``path``'s config.json, where it has one, against the
    model that config describes (built on meta, only then); the refusal names the file."""

    block = config.get("normswap")
    rotation = block.get("rotation") if isinstance(block, dict) else None
    if isinstance(rotation, dict) and "online_hadamard" in rotation:
        try:
            check_record(rotation["online_hadamard"], meta_model(config, auto_class))
        except NormswapError as error:
            raise NormswapError(f"{Path(path) / 'config.json'}: {error}") from None
