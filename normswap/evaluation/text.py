"""Text sources for perplexity: a local file or directory, the bundled held-out text, or a named dataset.

Every source becomes a list of *documents*. The strided perplexity runs over the documents joined
with blank lines (``"\\n\\n".join(documents)``, as in the transformers documentation); lm-eval's
rolling loglikelihood scores each document on its own, which is what lets the comparison report
a per-document difference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from normswap.errors import NormswapError, quoted
from normswap.evaluation.hub import require_hub

BUNDLED_TEXT = Path(__file__).resolve().parent.parent / "data" / "text" / "persuasion-excerpt.txt"
BUNDLED_NAMES = ("bundled", "default", "persuasion-excerpt")

# Named datasets: name -> (hub dataset path, config, split, lm-eval task scoring the same text).
DATASETS: dict[str, tuple[str, str, str, str | None]] = {
    "wikitext-2-raw-v1": ("Salesforce/wikitext", "wikitext-2-raw-v1", "test", "wikitext"),
    "wikitext-103-raw-v1": ("Salesforce/wikitext", "wikitext-103-raw-v1", "test", None),
}

# Local files are cut into documents of about this many characters (on paragraph boundaries), so a
# single novel still yields enough documents for a per-document comparison.
DEFAULT_DOC_CHARS = 4000


@dataclass
class TextSource:
    """Documents to score, with where they came from.

    ``documents`` are what lm-eval's rolling loglikelihood scores one by one; ``joined`` is the
    single string the strided recipe tokenises. ``lm_eval_task`` names a standard lm-eval task
    over the same text (e.g. ``wikitext``), used instead of a generated local task when set.
    """

    name: str
    documents: list[str]
    joined: str
    lm_eval_task: str | None = None
    origin: dict[str, str] = field(default_factory=dict)


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs of ``text``: blocks separated by blank lines, stripped, empty ones dropped."""
    return [block.strip() for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")) if block.strip()]


def group_paragraphs(paragraphs: list[str], doc_chars: int = DEFAULT_DOC_CHARS) -> list[str]:
    """Greedily pack consecutive paragraphs into documents of at least ``doc_chars`` characters."""
    documents: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in paragraphs:
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= doc_chars:
            documents.append("\n\n".join(current))
            current, size = [], 0
    if current:
        documents.append("\n\n".join(current))
    return documents


def check_text_file(path: Path) -> None:
    """Refuse, before any work, a text path that is missing or not a regular file."""
    if not path.exists():
        raise NormswapError(f"text file not found: {quoted(str(path))}")
    if not path.is_file():
        raise NormswapError(f"text file {quoted(str(path))} is not a regular file (a pipe, device or folder); "
                            "save the text to a file and pass that")


def read_text_file(path: Path, max_chars: int | None = None) -> str:
    """A UTF-8 text file (its first ``max_chars`` characters when given), for every command that
    reads one (eval's and geometry's ``--text``): a missing path, something other than a regular
    file, a file that is not UTF-8 or cannot be read is one ``NormswapError`` line."""
    check_text_file(path)
    try:
        with path.open(encoding="utf-8", errors="strict") as handle:
            text = handle.read(-1 if max_chars is None else max_chars)
    except UnicodeDecodeError as error:
        raise NormswapError(f"text file {quoted(str(path))} is not UTF-8 ({error.reason})") from None
    except OSError as error:
        raise NormswapError(f"cannot read text file {quoted(str(path))}: {error.strerror or error}") from None
    if "\0" in text:  # a binary file: no text holds NUL bytes
        raise NormswapError(f"text file {quoted(str(path))} is not text: it holds NUL bytes (byte {text.index(chr(0))})")
    return text


def _from_paths(name: str, files: list[Path], doc_chars: int) -> TextSource:
    paragraphs: list[str] = []
    documents: list[str] = []
    for file in files:
        file_paragraphs = split_paragraphs(read_text_file(file))
        paragraphs.extend(file_paragraphs)
        documents.extend(group_paragraphs(file_paragraphs, doc_chars))
    if not paragraphs:
        raise NormswapError(f"text source {name} contains no text")
    return TextSource(
        name=name,
        documents=documents,
        joined="\n\n".join(paragraphs),
        origin={"kind": "local", "files": ", ".join(str(f) for f in files)},
    )


def _from_dataset(name: str) -> TextSource:

    path, config, split, task = DATASETS[name]
    require_hub(f"dataset {name}")
    try:
        import datasets

        rows = datasets.load_dataset(path, config, split=split)["text"]
    except Exception as error:  # the datasets library raises many types for network failures
        raise NormswapError(
            f"could not fetch dataset {name} from the Hugging Face hub ({type(error).__name__}); "
            "pass --text FILE_OR_DIR for local text"
        ) from None
    # Exactly the transformers documentation's recipe: every line of the split, blank ones
    # included, joined with blank lines. The published GPT-2 anchor (29.94) was measured this way.
    return TextSource(
        name=name,
        documents=[row for row in rows if row.strip()],
        joined="\n\n".join(rows),
        lm_eval_task=task,
        origin={"kind": "dataset", "path": path, "config": config, "split": split},
    )


def text_file(spec: str | Path) -> Path:
    """The file a single-file text option names: ``bundled`` (and its other names) is the bundled
    held-out excerpt, anything else a path (``--calibration``, ``--held-out``, geometry's ``--text``)."""
    return BUNDLED_TEXT if str(spec) in BUNDLED_NAMES else Path(spec).expanduser()


def load_text(spec: str | Path | None = None, *, doc_chars: int = DEFAULT_DOC_CHARS) -> TextSource:
    """Resolve a text source.

    ``spec`` is ``None`` / ``"bundled"`` (the bundled held-out excerpt), a path to a UTF-8 text
    file, a directory (every ``*.txt`` inside, sorted, recursively), or a dataset name from
    ``DATASETS``. Raises ``NormswapError`` with one line when the source cannot be used.
    """
    if spec is None or str(spec) in BUNDLED_NAMES:
        if not BUNDLED_TEXT.is_file():
            raise NormswapError(f"the bundled held-out text is missing ({BUNDLED_TEXT}); pass --text FILE")
        source = _from_paths("bundled:persuasion-excerpt", [BUNDLED_TEXT], doc_chars)
        source.origin["kind"] = "bundled"
        return source
    if str(spec) in DATASETS:
        return _from_dataset(str(spec))
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_paths(str(path), [path], doc_chars)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise NormswapError(f"text directory {path} contains no .txt files")
        return _from_paths(str(path), files, doc_chars)
    raise NormswapError(
        f"text source {spec!s} is not a file, a directory, 'bundled', or a known dataset "
        f"({', '.join(DATASETS)})"
    )
