"""The one reader of the small JSON and YAML files normswap, transformers and lm-eval read.

A checkpoint's ``config.json``, its generation, tokenizer and processor configs, its index files,
recipes and task YAMLs are all untrusted. Python's parsers fail on them in ways that are not one
line: deep nesting is a ``RecursionError``, a 5000-digit integer a ``ValueError`` from the
int-from-string limit, a YAML alias bomb expands until ``MemoryError``, and a top-level list where
a mapping belongs is a ``TypeError`` somewhere later. Every such file goes through
``read_json`` / ``read_yaml`` first, which bound its size, nesting depth, integer length and
expanded size (YAML aliases included), check the top-level shape, and say in one line which file
is wrong and why. ``side_files`` runs them over a checkpoint folder before any of its files is
handed to a library.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

from normswap.errors import NormswapError, first_line

MAX_BYTES = 64 << 20  # the largest configuration file normswap reads (tokenizer configs run to MBs)
MAX_DEPTH = 64  # transformers' configs nest four deep; 64 leaves room for any real file
MAX_DIGITS = 40  # integers longer than this describe no model (int64 has 19 digits)
MAX_NODES = 5_000_000  # values in a JSON file (a 250k-token vocabulary has about 1.5 million)
MAX_YAML_NODES = 200_000  # values in a YAML file once its aliases are expanded (recipes and tasks are small)
MAX_ALIASES = 1000


def read_json(path: Path, *, what: str | None = None, mapping: bool = True, walk: bool = True,
              unique_keys: bool = False) -> Any:
    """The JSON value in ``path``, bounded as this module describes; ``mapping`` requires an object.

    ``what`` names the file in messages (default: its path). ``walk=False`` leaves out the walk
    that bounds depth and size (a tokenizer file of MBs, whose own parser bounds its depth):
    the parse itself stays bounded (integers, size, Python's recursion). ``unique_keys`` refuses
    an object that repeats a key, where parsers disagree or keep the last silently (a weight
    file's header or index naming one tensor twice).
    """
    return parse_json(_read_bytes(path, what), what or str(path), mapping=mapping, walk=walk, unique_keys=unique_keys)


# (absolute path, device, inode, size, modification time) -> the parsed value of a file read once
_READ_ONCE: dict[tuple, Any] = {}
_READ_ONCE_FILES = 16


def read_json_once(path: Path, *, what: str | None = None) -> Any:
    """``read_json(path)`` (an object), read and parsed once per process while the file stays the
    same file, unchanged (device, inode, size and modification time): a command that several
    steps ask for one checkpoint's config.json reads it once. Each caller gets its own copy."""
    try:
        info = os.stat(path)
        key = (os.path.abspath(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    except OSError:  # read_json names the problem
        return read_json(path, what=what)
    if key not in _READ_ONCE:
        value = read_json(path, what=what)
        if len(_READ_ONCE) >= _READ_ONCE_FILES:
            _READ_ONCE.pop(next(iter(_READ_ONCE)))
        _READ_ONCE[key] = value
    return copy.deepcopy(_READ_ONCE[key])


def parse_json(raw: bytes | str, what: str, *, mapping: bool = True, walk: bool = True,
               unique_keys: bool = False) -> Any:
    """``raw`` parsed as JSON with the bounds of ``read_json``; ``what`` names it in messages."""

    text = _decoded(raw, what)
    try:
        value = json.loads(text, parse_int=_bounded_int(what), object_pairs_hook=_unique(what) if unique_keys else None)
    except RecursionError:
        raise _unreadable(what, _TOO_DEEP) from None
    except json.JSONDecodeError as error:
        raise _unreadable(what, f"not valid JSON ({first_line(error)})") from None
    if not walk:
        return _checked(value, what, mapping, "a JSON object", "an array", max_nodes=1)
    return _checked(value, what, mapping, "a JSON object", "an array", max_nodes=MAX_NODES)


def read_yaml(path: Path, *, what: str | None = None, mapping: bool = True, loader: type | None = None) -> Any:
    """The YAML document in ``path``, bounded as this module describes, read by ``loader`` (a
    subclass of ``yaml.SafeLoader``; default the safe loader itself, which refuses every tag)."""
    where = what or str(path)
    return parse_yaml(_read_bytes(path, where), where, mapping=mapping, loader=loader)


def parse_yaml(raw: bytes | str, what: str, *, mapping: bool = True, loader: type | None = None) -> Any:
    """``raw`` parsed as one YAML document with the bounds of ``read_yaml``; ``what`` names it in messages."""
    import yaml

    where = what
    text = _decoded(raw, where)
    try:  # the reader refuses characters YAML does not allow (a NUL) as it is built
        loader = _bounded_loader_class(loader or yaml.SafeLoader)(text, where)
    except yaml.YAMLError as error:
        raise _unreadable(where, f"not valid YAML ({first_line(error)})") from None
    try:
        value = loader.get_single_data()
    except RecursionError:
        raise _unreadable(where, _TOO_DEEP) from None
    except yaml.YAMLError as error:
        raise _unreadable(where, f"not valid YAML ({first_line(error)})") from None
    except ValueError as error:  # a scalar PyYAML cannot build, such as a 5000-digit integer
        raise _unreadable(where, f"a value PyYAML cannot build ({first_line(error)})") from None
    finally:
        loader.dispose()
    return _checked(value, where, mapping, "a YAML mapping", "a list", max_nodes=MAX_YAML_NODES)


_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep"


def _unreadable(what: str, problem: str) -> NormswapError:
    return NormswapError(f"cannot read {what}: {problem}")


def read_text_file(path: Path, what: str, *, max_chars: int | None = None, allow_empty: bool = False) -> str:
    """The UTF-8 text of ``path`` (at most ``max_chars`` characters), refused in one line naming
    ``what`` it is (``text file``, ``calibration text``) when missing, unreadable, not UTF-8, holding
    NUL bytes (a binary file: no text has them), or empty unless ``allow_empty``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NormswapError(f"{what} not found: {path}")
    try:
        with path.open(encoding="utf-8") as handle:
            text = handle.read() if max_chars is None else handle.read(max_chars)
    except UnicodeDecodeError as error:
        raise NormswapError(f"{what} {path} is not UTF-8 ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise NormswapError(f"cannot read {what} {path}: {error.strerror or first_line(error)}") from None
    if "\0" in text:
        raise NormswapError(f"{what} {path} is not text: it holds NUL bytes (byte {text.index(chr(0))})")
    if not allow_empty and not text.strip():
        raise NormswapError(f"{what} is empty: {path}")
    return text


def _read_bytes(path: Path, what: str | None) -> bytes:
    where = what or str(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
    except OSError as error:
        raise _unreadable(where, error.strerror or first_line(error)) from None
    if len(raw) > MAX_BYTES:
        raise _unreadable(where, f"larger than {MAX_BYTES >> 20} MiB, which no configuration file is")
    return raw


def _decoded(raw: bytes | str, what: str) -> str:
    if isinstance(raw, str):
        return raw
    try:  # strict: transformers and lm-eval read these files as UTF-8, and JSON refuses a BOM
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _unreadable(what, f"not UTF-8 text (byte {error.start} is {raw[error.start]:#04x})") from None


def _bounded_int(what: str):
    def parse(text: str) -> int:
        if len(text.lstrip("-")) > MAX_DIGITS:
            raise _unreadable(what, f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_DIGITS} are read)")
        return int(text)

    return parse


def _unique(what: str):
    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key, value in pairs:
            if key in found:
                raise _unreadable(what, f"it names {key!r:.60} twice in one object")
            found[key] = value
        return found

    return build


def _checked(value: Any, what: str, mapping: bool, kind: str, list_word: str, *, max_nodes: int) -> Any:
    """``value`` once its depth and expanded size are within bounds (walked without recursion,
    shared YAML nodes counted at every use; ``max_nodes=1``: not walked) and, with ``mapping``, it
    is a mapping."""
    stack, nodes = [(value, 1)] if max_nodes > 1 else [], 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH:
            raise _unreadable(what, _TOO_DEEP)
        if nodes > max_nodes:
            raise _unreadable(what, f"it expands to more than {max_nodes:,} values")
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for pair in item.items() for child in pair)
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, int) and not isinstance(item, bool) and len(str(abs(item))) > MAX_DIGITS:
            raise _unreadable(what, f"an integer of more than {MAX_DIGITS} digits")
    if mapping and not isinstance(value, dict):
        found = "null (an empty file?)" if value is None else json_kind(value, list_word)
        raise NormswapError(f"{what} must hold {kind}, not {found}")
    return value


def json_kind(value: Any, list_word: str = "an array") -> str:
    """What a parsed JSON or YAML value is, in words: ``a string``, ``an object``, ``null``..."""
    if value is None:
        return "null"
    words = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: list_word,
             dict: "an object"}
    return next((word for kind, word in words.items() if isinstance(value, kind)), type(value).__name__)


@functools.cache
def _bounded_loader_class(base: type) -> type:
    import yaml

    class BoundedLoader(base):
        """``base`` (a safe loader) with a cap on aliases and on nesting while composing."""

        def __init__(self, text: str, what: str) -> None:
            super().__init__(text)
            self.what, self.aliases, self.depth = what, 0, 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_ALIASES:
                    raise _unreadable(self.what, f"more than {MAX_ALIASES} YAML aliases")
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise _unreadable(self.what, _TOO_DEEP)
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return BoundedLoader
