"""Tiny inputs that ask for unbounded work: each ends in bounded time, with one line or success.

* a zero-size tensor whose first dimension is 2**62: loops over a tensor are bounded by its
  bytes, never by a dimension (``verify.proof``'s row chunks, ``CheckpointReader.read_as``);
* a tokenizer whose pre-tokenizer regex makes the Rust tokenizer panic
  (``pyo3_runtime.PanicException``, a ``BaseException``): one line naming the file and the regex.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import tiny_gpt2

from normswap.checkpoint.source import CheckpointReader, example_model_path
from normswap.cli import main

HUGE_DIM = 2 ** 62


@pytest.fixture(scope="module")
def zero_size_source(tmp_path_factory) -> Path:
    """A tiny GPT-2 whose shard also holds ``extra.empty``, F32 of shape [2**62, 0] (no bytes)."""
    path = tiny_gpt2(tmp_path_factory.mktemp("bounds") / "gpt2")
    shard = path / "model.safetensors"
    raw = shard.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + size]), raw[8 + size:]
    end = max(entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__")
    header["extra.empty"] = {"dtype": "F32", "shape": [HUGE_DIM, 0], "data_offsets": [end, end]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_a_zero_size_tensor_with_a_huge_dimension_is_read_without_walking_it(zero_size_source):
    with CheckpointReader(zero_size_source) as reader:
        value = reader.read_as("extra.empty", torch.float64, slice_bytes=64)
    assert value.shape == (HUGE_DIM, 0) and value.dtype == torch.float64


def test_a_zero_size_tensor_with_a_huge_dimension_converts_and_is_proven(zero_size_source, tmp_path, capsys):
    assert main(["convert", str(zero_size_source), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    with CheckpointReader(tmp_path / "out") as reader:
        assert reader.tensors["extra.empty"].shape == (HUGE_DIM, 0)
    assert "weights proven" in capsys.readouterr().out


PANIC_REGEX = "(a|a)+$"


@pytest.fixture(scope="module")
def panicking_tokenizer(tmp_path_factory) -> tuple[Path, Path]:
    """The bundled example with a ``Split`` pre-tokenizer whose regex makes Oniguruma give up
    (read as a ``PreTrainedTokenizerFast``, so tokenizer.json is used as written), and a text
    that trips it."""
    root = tmp_path_factory.mktemp("panic")
    model = root / "model"
    shutil.copytree(example_model_path(), model)
    data = json.loads((model / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": PANIC_REGEX}, "behavior": "Isolated",
                             "invert": False}
    (model / "tokenizer.json").write_text(json.dumps(data))
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    text = root / "text.txt"
    text.write_text(("a" * 40 + "b ") * 50)
    return model, text


@pytest.mark.parametrize("command", [["geometry"], ["eval", "--device", "cpu"]])
def test_a_tokenizer_panic_is_one_line_naming_the_file_and_the_regex(panicking_tokenizer, capfd, command):
    model, text = panicking_tokenizer
    assert main([command[0], str(model), "--text", str(text), *command[1:], "--no-progress"]) == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines  # the Rust library's own panic lines are held back too
    assert f"{model / 'tokenizer.json'}" in lines[0] and repr(PANIC_REGEX) in lines[0], lines[0]


def test_a_panic_outside_the_held_back_calls_is_one_line_from_the_runner(panicking_tokenizer, capsys, monkeypatch):
    from normswap.checkpoint import tokenizer_panics

    model, text = panicking_tokenizer
    monkeypatch.setattr(tokenizer_panics, "held_back", lambda folder: contextlib.nullcontext())
    assert main(["geometry", str(model), "--text", str(text), "--no-progress"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("normswap geometry: error: the tokenizer of"), lines
    assert repr(PANIC_REGEX) in lines[0]


def test_a_slow_tokenizer_regex_ends_at_its_deadline(panicking_tokenizer, tmp_path, capsys, monkeypatch):
    """A regex that backtracks at every position without panicking: the tokenization has a
    deadline (here shortened to 0.05 s; the text takes the tokenizer about 0.4 s)."""
    from normswap.checkpoint import tokenizer_panics

    model, _ = panicking_tokenizer
    slow = tmp_path / "model"
    shutil.copytree(model, slow)
    data = json.loads((slow / "tokenizer.json").read_text())
    data["pre_tokenizer"]["pattern"]["Regex"] = "(a|aa)+c"
    (slow / "tokenizer.json").write_text(json.dumps(data))
    text = tmp_path / "text.txt"
    text.write_text(("a" * 22 + "b") * 200)
    monkeypatch.setattr(tokenizer_panics, "TOKENIZE_SECONDS", 0.05)
    assert main(["geometry", str(slow), "--text", str(text), "--no-progress"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "took more than 0 s" in lines[0] and "'(a|aa)+c'" in lines[0], lines
