"""The files of a checkpoint folder that normswap, or a library it calls, reads or copies.

Every one of them must be a regular file lying inside the checkpoint once links are resolved. A
checkpoint is untrusted: ``tokenizer.json`` linked to ``/etc/passwd`` would otherwise be read by
the tokenizer and copied into the output, and a FIFO named ``config.json`` would block the reader
for ever. Links themselves are fine while they stay inside: the Hugging Face hub cache links each
file of ``models--org--name/snapshots/<rev>/`` to ``models--org--name/blobs/``, which counts as
inside that snapshot.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from normswap.errors import NormswapError

# Files copied from the source checkpoint into every output as they are (tokenizers, processors,
# generation settings).
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.txt", "generation_config.json",
    "preprocessor_config.json", "processor_config.json", "feature_extractor_config.json",
    "normalizer.json", "chat_template.jinja", "chat_template.json",
)
# Files read in place (configuration and weights); every top-level ``*.py`` is read too (the
# modeling file normswap verifies, and the code transformers would import with trust_remote_code).
READ_FILES = (
    "config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json", "video_preprocessor_config.json", "audio_config.json",
)


def check_utf8_path(path: Path, what: str) -> None:
    """Refuse a path the file system holds but UTF-8 does not decode (a byte such as 0xff in a
    folder's name): the safetensors library, with which transformers loads weights, opens only
    UTF-8 paths, so such a checkpoint could be read but never loaded or verified. ``what`` names
    the path in the message (``--out``)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        raise NormswapError(f"{what} {shown} is not a UTF-8 path; transformers' safetensors loader opens only UTF-8 "
                            "paths, so rename it") from None


def allowed_roots(folder: Path) -> list[Path]:
    """The real folders a checkpoint's files may resolve into: the folder itself and, for a hub
    cache snapshot, its repository's ``blobs/``."""
    real = Path(os.path.realpath(folder))
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        roots.append(real.parent.parent / "blobs")
    return roots


def inside_file(folder: Path, name: str, roots: list[Path] | None = None, *,
                within: str = "the checkpoint") -> Path | None:
    """``folder / name`` resolved, when it exists; None when it does not. A name or link that
    resolves outside ``roots`` (default ``allowed_roots(folder)``; ``within`` names them in the
    message), a dangling link and anything that is not a regular file are refused."""
    path = folder / name
    if not os.path.lexists(path):
        return None
    real = Path(os.path.realpath(path))
    roots = roots if roots is not None else allowed_roots(folder)
    if not any(real == root or root in real.parents for root in roots):
        how = "is a link to" if os.path.islink(path) else "resolves to"
        raise NormswapError(f"{path} {how} {real}, outside {within}; normswap reads only files inside it")
    try:
        mode = os.stat(real).st_mode
    except OSError as error:
        raise NormswapError(f"cannot read {path}: {error.strerror}") from None
    if not stat.S_ISREG(mode):
        raise NormswapError(f"{path} is not a regular file; normswap reads only regular files")
    return real


def check_files(folder: Path, extra: tuple[str, ...] = ()) -> None:
    """Refuse, with one line, a checkpoint any of whose read or copied files (``READ_FILES``,
    ``SIDE_FILES``, every top-level ``*.py``, and ``extra``: e.g. the shards an index names) is a
    link outside it or not a regular file."""
    roots = allowed_roots(folder)
    try:
        code = sorted(entry.name for entry in os.scandir(folder) if entry.name.endswith(".py"))
    except OSError as error:
        raise NormswapError(f"cannot read {folder}: {error.strerror}") from None
    for name in (*READ_FILES, *SIDE_FILES, *code, *extra):
        inside_file(folder, name, roots)


def copy_inside_file(folder: Path, name: str, destination: Path) -> bool:
    """Copy ``folder / name`` to ``destination`` when it exists; False when it does not.

    The file is opened once, by its resolved path, and checked again on the open descriptor (a
    regular file inside the checkpoint), so a link swapped after ``check_files`` copies nothing
    from outside.
    """
    real = inside_file(folder, name)
    if real is None:
        return False
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NormswapError(f"{folder / name} is not a regular file; normswap copies only regular files")
        with open(destination, "xb") as target, os.fdopen(os.dup(fd), "rb") as source:
            while chunk := source.read(1 << 20):
                target.write(chunk)
    finally:
        os.close(fd)
    return True
