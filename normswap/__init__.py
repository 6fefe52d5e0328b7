"""normswap: exact LayerNorm → RMSNorm conversion of transformer checkpoints.

Public API:

- ``convert_checkpoint(src, out, ...)``: convert a checkpoint directory or hub id, write and verify.
- ``verify_checkpoint(original, converted)``: compare a converted checkpoint with its original
  (every stored tensor proven against the plan, then the loaders run on a short probe);
  ``prove_checkpoint(original, converted)``: the weights proof alone.
- ``load(path)``: a converted checkpoint as an RMSNorm model using normswap's kernels.
- ``load_model(src)``: any checkpoint (original or converted) and its tokenizer, for evaluation.
- ``convert_model(model)``: convert a model already in memory; ``save(model, folder)`` (or its
  ``save_pretrained``) writes it as ``convert`` would.
- ``patch(model)``: substitute normswap's fused kernels into an RMSNorm model.

``import normswap`` is light: torch and transformers are imported when one of these names is
first used, so the command line starts at once. The ``normswap_<type>`` model types are
registered with transformers' Auto classes (``normswap.modeling.registry``) as soon
as both are imported: when transformers is imported after normswap, when normswap is imported
after transformers, or when one of these names is first used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "NormswapError": "normswap.errors",
    "VerificationError": "normswap.errors",
    "convert_checkpoint": "normswap.api",
    "rotate_checkpoint": "normswap.api",
    "verify_checkpoint": "normswap.verify.checkpoint",
    "prove_checkpoint": "normswap.verify.checkpoint",
    "convert_model": "normswap.api",
    "save": "normswap.api",
    "load": "normswap.api",
    "load_model": "normswap.api",
}

__all__ = sorted([*_EXPORTS, "__version__", "patch"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        if "transformers" in sys.modules:  # imported just now by that module, whose import it was
            _register_auto_classes()
        return value
    raise AttributeError(f"module 'normswap' has no attribute {name!r}")


def patch(model: Any) -> Any:
    """Substitute normswap's fused RMSNorm kernels into ``model`` (see ``normswap.kernels.patch``);
    ``model`` must be a ``torch.nn.Module`` (a ``TypeError`` otherwise)."""
    from normswap.kernels.patch import patch as _patch

    return _patch(model)


def _importing_normswap() -> bool:
    """Whether a normswap submodule is part-way through its own import.

    The package itself does not count: it registers as the last statement of its own import,
    once every name here is defined, and the registry imports nothing from it.
    """
    return any(
        getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
        if name.startswith("normswap.")
    )


def _register_auto_classes() -> None:
    # When a normswap submodule is part-way through its own import, registering now could see it
    # half-built; every path that loads a model registers before it does, so nothing is lost.
    # Registering twice is a no-op, so the order transformers and normswap are imported in
    # decides only when this runs, never what is registered.
    if not _importing_normswap():
        importlib.import_module("normswap.modeling.registry").register_auto_classes()


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """Runs ``_register_auto_classes`` right after ``transformers`` is imported, by anyone."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        sys.meta_path.remove(self)
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_auto_classes()

        loader.exec_module = exec_then_register
        return spec


if "transformers" in sys.modules:
    _register_auto_classes()
elif not any(isinstance(finder, _AfterTransformersImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AfterTransformersImport())
