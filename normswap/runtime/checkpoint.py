"""``Checkpoint``: one checkpoint folder as every command sees it, opened once.

A command resolves its source once (a folder, the bundled example or a hub id) and then asks the
value for what it needs: the config (parsed once, and only when first asked for, so that the
output folder is claimed before a bad config.json is read), the tensor reader (headers read on
first use, the shards' files closed with the value), the family's adapter and the provenance a
normswap checkpoint carries. Pipelines, the install and verification take the value instead of
the folder, its config and its reader as loose arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from normswap.architectures import Architecture, architecture_for
from normswap.checkpoint.provenance import Provenance, family_config
from normswap.checkpoint.source import CheckpointReader, read_config, resolve_source, source_inputs


@dataclass(eq=False)
class Checkpoint:
    """The checkpoint at ``folder``, named ``name`` as the user gave it (a hub id, a path; for a
    hub id, at ``revision``).

    Use it as a context manager: leaving it closes the reader's shards."""

    folder: Path
    name: str
    revision: str | None = None
    _reader: CheckpointReader | None = field(default=None, repr=False)

    @classmethod
    def open(cls, src: str | Path, *, trust_remote_code: bool = False, revision: str | None = None) -> Checkpoint:
        """The checkpoint ``src`` names, resolved as ``resolve_source`` resolves it (downloaded
        from the hub, at ``revision``, where it is a hub id)."""
        return cls(resolve_source(src, trust_remote_code=trust_remote_code, revision=revision), str(src), revision)

    @classmethod
    def at(cls, folder: Path) -> Checkpoint:
        """A folder normswap is writing or has written (no resolution: it may not be finished)."""
        return cls(Path(folder), str(folder))

    @cached_property
    def config(self) -> dict:
        """config.json, parsed once."""
        return read_config(self.folder)

    @cached_property
    def provenance(self) -> Provenance | None:
        """The checked ``normswap`` block of a checkpoint normswap wrote; None for any other."""
        return Provenance.of(self.config, self.folder)

    @cached_property
    def architecture(self) -> Architecture:
        """The family's adapter (of the family converted from, for a normswap checkpoint), or a
        one-line refusal saying why there is none."""
        return architecture_for(family_config(self.config))

    @property
    def reader(self) -> CheckpointReader:
        """The checkpoint's tensors, read lazily; opened on first use."""
        if self._reader is None:
            self._reader = CheckpointReader(self.folder)
        return self._reader

    def inputs(self) -> list[Path]:
        """The folder and the files behind its links: what no output may hold or lie inside."""
        return source_inputs(self.folder)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def checkpoint_of(source: str | Path | Checkpoint, *, trust_remote_code: bool = False) -> Checkpoint:
    """``source`` as a ``Checkpoint``: the value itself, or the folder or hub id it names."""
    if isinstance(source, Checkpoint):
        return source
    return Checkpoint.open(source, trust_remote_code=trust_remote_code)
