"""What verification, calibration and evaluation share about running a checkpoint: the reference
model of a source, its tokenizer, and text turned into token ids."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.architectures import Architecture
from normswap.checkpoint.side_files import check_token_ids, vocab_size
from normswap.checkpoint.source import read_config
from normswap.checkpoint.tokenizer_panics import tokenized
from normswap.modeling import build
from normswap.runtime.loaders import load_converted


def load_tokenizer(path: Path, config: dict | None = None) -> Any:
    """The checkpoint's tokenizer, or None when it has none or it cannot be built offline.

    A tokenizer whose ids run past the model's vocabulary (from ``config``, the checkpoint's
    config.json when the caller has read it) is refused: each such token would index past the end
    of the embedding table.
    """
    if not any((path / name).is_file() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        ids = max([len(tokenizer), *(index + 1 for index in tokenizer.get_vocab().values())])
    except Exception:  # a broken tokenizer must not stop verification: random ids still work
        return None
    check_token_ids(ids, vocab_size(config if config is not None else read_config(path)), f"{path}")
    return tokenizer


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids of ``text`` as one 1-D tensor, untruncated.

    Special tokens are added exactly as the tokenizer does by default (the documentation's recipe):
    none for GPT-2, a leading BOS for OPT or Llama, which then gives the first word a context.
    """

    folder = Path(getattr(tokenizer, "name_or_path", "") or ".")
    # the text is far longer than the model context on purpose; a panic of the tokenizer's regex is
    # one line, and its time is bounded
    with transformers_errors_only():
        encoded = tokenized(folder, lambda: tokenizer(text, return_tensors="pt"), len(text))
    return encoded["input_ids"][0]


@contextmanager
def transformers_errors_only() -> Iterator[None]:
    """Silence transformers' warnings in the block: whole documents are encoded on purpose (strided
    windows, lm-eval's rolling windows), and the tokenizer warns that they exceed the context."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def reference_model(path: Path, architecture: Architecture, dtype: torch.dtype = torch.float32,
                    rms_how: str = "rmsnorm", config: dict | None = None) -> nn.Module:
    """The source of a rotation as a model: the stock class for an original, else its RMSNorm form
    (normswap's own classes, or with ``rms_how="remote"`` the checkpoint's own code)."""
    config = read_config(path) if config is None else config
    if "normswap" in config:
        return load_converted(path, rms_how, dtype=dtype, config=config)
    return build.load_pretrained(build.model_class(config, architecture.auto_class), path, dtype=dtype)


# the config keys of the longest sequence a family's positions allow (MPT: max_seq_len)
CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "max_target_positions", "max_seq_len",
                "seq_length", "max_sequence_length")


def config_context_length(config: dict) -> int | None:
    """The maximum sequence length a config.json declares, or None when it declares none."""
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def context_length(model: nn.Module, default: int = 1024) -> int:
    """The model's maximum sequence length from its config (n_positions, max_position_embeddings...)."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    found = config_context_length(to_dict()) if callable(to_dict) else None
    return found or default
