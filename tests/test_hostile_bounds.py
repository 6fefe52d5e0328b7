"""Tiny inputs that ask for unbounded work: each ends in bounded time, with one line or success.

* a zero-size tensor whose first dimension is 2**62: loops over a tensor are bounded by its
  bytes, never by a dimension (``verify.proof``'s row chunks, ``CheckpointReader.read_as``);
* a tokenizer whose pre-tokenizer regex makes the Rust tokenizer panic
  (``pyo3_runtime.PanicException``, a ``BaseException``): one line naming the file and the regex.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import tiny_gpt2

from normswap.checkpoint.source import CheckpointReader
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
