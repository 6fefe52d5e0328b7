"""Lazily imported package attributes, so that building the command line does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module name) on first use of ``name``."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def lazy_exports(package: str, modules: Mapping[str, tuple[str, ...]]) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for a package that exports each of ``modules[module]`` lazily from ``module``."""
    exports = {name: module for module, names in modules.items() for name in names}
    return lazy_getattr(package, exports), sorted(exports)
