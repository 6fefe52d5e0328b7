"""Arguments of the public Python API, checked at the door as the command line checks its own.

``checked`` wraps a public function so that each argument is held to its type hint before the
body runs: a wrong type is a ``TypeError`` naming the function, the parameter and what it
accepts. Hints are read at call time (``from __future__ import annotations`` keeps them as text)
in the function's module; the ones checked are plain classes, ``X | None`` unions, ``bool``
(``True``/``False`` only, never 1 or "yes"), ``int`` (not ``bool``), ``float`` (an int is fine),
``str | Path`` (also any ``os.PathLike``) and ``list[str]``. Hints that say more than a class
(callables, ``Any``) are left to the body, which checks values and raises ``NormswapError``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from normswap.errors import ArgumentError, quoted

F = TypeVar("F", bound=Callable[..., Any])


def _names(kinds: tuple[type, ...]) -> str:
    names = []
    for kind in kinds:
        if kind is type(None):
            names.append("None")
        elif kind is Path:
            names.append("a path (str or os.PathLike)")
        else:
            names.append(kind.__name__)
    return " or ".join(dict.fromkeys(names))


def _kinds(hint: Any) -> tuple[type, ...] | None:
    """The classes a hint admits, or None when it is not a plain union of classes."""
    if hint is Any or hint is inspect.Parameter.empty:
        return None
    if isinstance(hint, type):
        return (hint,)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        kinds: list[type] = []
        for part in typing.get_args(hint):
            found = _kinds(part)
            if found is None:
                return None
            kinds += found
        return tuple(kinds)
    if origin in (list, tuple, dict):
        return (origin,)
    return None


def accepts(value: Any, kinds: tuple[type, ...]) -> bool:
    """Whether ``value`` is one of ``kinds``, with bool, int, float and paths held strictly."""
    for kind in kinds:
        if kind is bool:
            if isinstance(value, bool):
                return True
        elif kind is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif kind is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return True
        elif kind is Path:
            if isinstance(value, (str, os.PathLike)):
                return True
        elif isinstance(value, kind):
            return True
    return False


def check_argument(where: str, name: str, value: Any, hint: Any) -> None:
    """Raise ``TypeError`` when ``value`` does not fit ``hint`` (see the module docstring)."""
    kinds = _kinds(hint)
    if kinds is None or accepts(value, kinds):
        if kinds is not None and list in kinds and isinstance(value, list) and typing.get_args(hint):
            inner = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
            if inner is str and not all(isinstance(item, str) for item in value):
                raise TypeError(f"{where}: {name} must be a list of str")
        return
    raise TypeError(f"{where}: {name} must be {_names(kinds)}, not {type(value).__name__} ({value!r:.40})")


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(func)
    except Exception:  # a hint naming something only imported for type checking
        hints = {}
        module = inspect.getmodule(func)
        for name, text in getattr(func, "__annotations__", {}).items():
            try:
                hints[name] = eval(text, vars(module)) if isinstance(text, str) else text  # noqa: S307 (our own hints)
            except Exception:
                continue
        return hints


def checked(func: F) -> F:
    """``func`` with every argument checked against its type hint before it runs."""
    signature = inspect.signature(func)
    where = f"{func.__module__.split('.')[0]}.{func.__name__}"
    resolved: dict[str, Any] | None = None

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal resolved
        if resolved is None:
            resolved = _hints(func)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{where}: {error}") from None
        for name, value in bound.arguments.items():
            parameter = signature.parameters[name]
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            check_argument(where, name, value, resolved.get(name, inspect.Parameter.empty))
        return func(*args, **kwargs)

    return call  # type: ignore[return-value]


def check_fields(instance: Any) -> None:
    """A dataclass's fields against their hints (for ``__post_init__``)."""

    hints = _hints(type(instance))
    for field in dataclasses.fields(instance):
        check_argument(type(instance).__name__, field.name, getattr(instance, field.name), hints.get(field.name))


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_map(where: str, device_map: Any) -> None:
    """Refuse a ``device_map`` that ``from_pretrained`` would reject deep inside a run: a
    ``TypeError`` for a wrong type, an ``ArgumentError`` (a ``ValueError``) for a bad value."""
    if device_map is None or isinstance(device_map, dict) or device_map in DEVICE_MAPS:
        return
    import torch

    if isinstance(device_map, bool) or not isinstance(device_map, (str, int, torch.device)):
        raise TypeError(f"{where}: device_map must be a str, int, torch.device or dict, not {type(device_map).__name__}")
    try:
        torch.device(device_map)
    except (RuntimeError, ValueError):
        raise ArgumentError(f"{where}: device_map {quoted(device_map, 40)} is neither a device nor one of "
                            f"{', '.join(DEVICE_MAPS)}") from None
