"""Hostile inputs through the real CLI: each case asserts the trust promises.

* code from a checkpoint or recipe never runs (marker files never appear);
* nothing the user owns is lost: the source tree's file hashes are unchanged, a folder that is
  not normswap's is never replaced, and nothing new is left beside or at ``--out``;
* every bad input is exactly one line on stderr, a non-zero exit, and no traceback.

Cases run in-process through ``normswap.cli.main`` (fast); the concurrency race and an
interrupted process use real subprocesses.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import leftovers, quick_first, tiny_gpt2
from transformers import GPT2LMHeadModel

from normswap.checkpoint import output, temporaries
from normswap.cli import main
from normswap.errors import NormswapError

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny two-layer GPT-2 (safetensors, tied head), never modified by any test."""
    return tiny_gpt2(tmp_path_factory.mktemp("hostile") / "gpt2")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile-converted") / "rms"
    assert main(["convert", str(source), "--out", str(out), "--quiet"]) == 0
    return out


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed) with its sha256, and every link's target."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = "link:" + os.readlink(path)
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[key] = "dir"
    return found


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, *needles: str, exit_code: int | None = 2) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert code != 0
    if exit_code is not None:
        assert code == exit_code, (code, err)
    assert "weights_only=False" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


class Guard:
    """The state a hostile case must leave as it found it: ``watched`` folders, file by file."""

    def __init__(self, *watched: Path) -> None:
        self.watched = [Path(path) for path in watched]
        self.before = [tree_hashes(path) if path.exists() else None for path in self.watched]

    def unchanged(self) -> None:
        after = [tree_hashes(path) if path.exists() else None for path in self.watched]
        for path, old, new in zip(self.watched, self.before, after, strict=True):
            assert old == new, f"{path} changed"


def refused_leaving_unchanged(watched: list[Path], capsys, *args, needle: str = "") -> str:
    """Run the CLI with ``args``: it must refuse in one line that names ``needle`` (exit 2) and
    leave every ``watched`` folder as it found it. Returns the line."""
    guard = Guard(*watched)
    code, _, err = run_cli(capsys, *args)
    line = assert_refused(code, err, needle)
    guard.unchanged()
    return line


def copy_source(source: Path, tmp_path: Path, name: str = "src") -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


class Replace:
    """Returned by a config change: write ``value`` as the whole config.json."""

    def __init__(self, value) -> None:
        self.value = value


def edit_config(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    result = change(config)
    (folder / "config.json").write_text(json.dumps(result.value if isinstance(result, Replace) else config))


def write_safetensors(path: Path, header: dict, data: bytes, *, length: int | None = None) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + data)


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + length]), raw[8 + length:]


# ---------------------------------------------------------------------------------------------
# config.json: every case refused before any weight is read, by convert and by inspect

def _set(**values):
    return lambda config: config.update(values)


def _drop(key):
    return lambda config: config.pop(key) and None


CONFIG_CASES = {
    "null": (lambda config: Replace(None), "JSON object"),
    "list": (lambda config: Replace([config]), "JSON object"),
    "string": (lambda config: Replace("gpt2"), "JSON object"),
    "number": (lambda config: Replace(7), "JSON object"),
    "n_embd-string": (_set(n_embd="16"), "'n_embd' must be a positive integer"),
    "n_embd-float": (_set(n_embd=16.0), "'n_embd' must be a positive integer"),
    "n_embd-bool": (_set(n_embd=True), "'n_embd' must be a positive integer"),
    "n_embd-negative": (_set(n_embd=-16), "'n_embd' must be a positive integer"),
    "n_embd-zero": (_set(n_embd=0), "'n_embd' must be a positive integer"),
    "n_embd-list": (_set(n_embd=[16]), "'n_embd' must be a positive integer"),
    "n_head-indivisible": (_set(n_head=3), "not divisible"),
    "n_head-string": (_set(n_head="2"), "'n_head' must be a positive integer"),
    "n_head-zero": (_set(n_head=0), "'n_head' must be a positive integer"),
    "n_layer-negative": (_set(n_layer=-1), "'n_layer' must be a positive integer"),
    "n_layer-string": (_set(n_layer="2"), "'n_layer' must be a positive integer"),
    "n_layer-5000": (_set(n_layer=5000), "the weights hold 2 layers"),
    "n_layer-3": (_set(n_layer=3), "the weights hold 2 layers"),
    "n_layer-1": (_set(n_layer=1), "the weights hold 2 layers"),
    "eps-string": (_set(layer_norm_epsilon="1e-5"), "'layer_norm_epsilon' must be a non-negative number"),
    "eps-negative": (_set(layer_norm_epsilon=-1e-5), "'layer_norm_epsilon' must be a non-negative number"),
    "eps-null-list": (_set(layer_norm_epsilon=[1e-5]), "'layer_norm_epsilon' must be a non-negative number"),
    "vocab-string": (_set(vocab_size="50"), "'vocab_size' must be a positive integer"),
    "vocab-mismatch": (_set(vocab_size=60), "implies"),
    "n_embd-mismatch": (_set(n_embd=32), "implies"),
    "n_positions-mismatch": (_set(n_positions=32), "implies"),
    "n_positions-zero": (_set(n_positions=0), "'n_positions' must be a positive integer"),
    "n_inner-negative": (_set(n_inner=-4), "'n_inner' must be a positive integer"),
    "n_inner-mismatch": (_set(n_inner=48), "implies"),
    "rotary_dim-above-head": (_set(rotary_dim=99), "'rotary_dim' = 99 exceeds the head dimension 8"),
    "rotary_pct-negative": (_set(rotary_pct=-0.5), "'rotary_pct' must be a number from 0 to 1"),
    "partial_rotary_factor-odd": (_set(rope_parameters={"partial_rotary_factor": 0.375}), "an odd number"),
    "tie-string": (_set(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false"),
    "eps-nan": (_set(layer_norm_epsilon=math.nan), "'layer_norm_epsilon' must be a non-negative number"),
    "activation-unknown": (_set(activation_function="not_an_activation"), "activation"),
    "activation-number": (_set(activation_function=3), "activation"),
    "architectures-other-family": (_set(architectures=["BloomForCausalLM"]), "a bloom class"),
    "architectures-string": (_set(architectures="GPT2LMHeadModel"), "'architectures' must be a list"),
    "architectures-numbers": (_set(architectures=[1, 2]), "'architectures' must be a list"),
    "model_type-missing": (_drop("model_type"), "'model_type' must be a string"),
    "model_type-number": (_set(model_type=2), "'model_type' must be a string"),
    "model_type-unknown": (_set(model_type="llama"), "unsupported architecture 'llama'"),
    "model_type-post-ln": (_set(model_type="bert"), "post-LN"),
    "already-converted": (_set(normswap={"version": "0"}), "already converted"),
    "num_labels-huge": (_set(num_labels=10**8), "'num_labels' must be an integer from 0 to 1000000"),
    "num_labels-string": (_set(num_labels="2"), "'num_labels' must be an integer"),
    "text_config-in-gpt2": (_set(text_config={}), "a gpt2 config has no 'text_config'"),
    "decoder-in-gpt2": (_set(decoder=5), "a gpt2 config has no 'decoder'"),
}


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config(source, tmp_path, capsys, command, case):
    change, needle = CONFIG_CASES[case]
    src = copy_source(source, tmp_path)
    edit_config(src, change)
    guard = Guard(src)
    out = tmp_path / "out"
    started = time.perf_counter()
    args = ["convert", src, "--out", out] if command == "convert" else ["inspect", src]
    code, _, err = run_cli(capsys, *args)
    assert_refused(code, err, needle)
    assert time.perf_counter() - started < 60  # refused up front, never after building the model
    guard.unchanged()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]


def test_unreadable_config_json(source, tmp_path, capsys):
    src = copy_source(source, tmp_path)
    (src / "config.json").write_text("{not json")
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out")
    assert_refused(code, err, "cannot read")
    (src / "config.json").write_bytes(b"\xff\xfe{}")
    code, _, err = run_cli(capsys, "inspect", src)
    assert_refused(code, err, "cannot read")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# weight files


def _overlap(header, data):
    by_size = {}
    for name, entry in sorted(header.items()):
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            by_size.setdefault(end - begin, []).append(name)
    first, second = next(names for names in by_size.values() if len(names) >= 2)[:2]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])
    return header, data


def _past_end(header, data):
    name = sorted(name for name in header if name != "__metadata__")[0]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [10**9, 10**9 + end - begin]
    return header, data


def _entry(name_index: int, key: str, value):
    def change(header, data):
        names = sorted(name for name in header if name != "__metadata__")
        header[names[name_index]][key] = value
        return header, data
    return change


def _gap(header, data):
    for name, entry in header.items():
        if name != "__metadata__":
            entry["data_offsets"] = [offset + 4 for offset in entry["data_offsets"]]
    return header, b"\0" * 4 + data


def _negative_dims(header, data):
    name = next(name for name, entry in header.items() if name != "__metadata__" and len(entry["shape"]) == 2)
    rows, cols = header[name]["shape"]
    header[name]["shape"] = [-rows, -cols]
    return header, data


def _wrong_dtype_size(header, data):
    name = next(name for name, entry in header.items() if name != "__metadata__" and entry["dtype"] == "F32")
    header[name]["dtype"] = "F16"
    return header, data


SAFETENSORS_CASES = {
    "overlapping-offsets": (_overlap, "overlaps"),
    "trailing-bytes": (lambda header, data: (header, data + b"\0" * 8), "trailing bytes"),
    "gap": (_gap, "belong to no tensor"),
    "negative-dims": (_negative_dims, "non-negative integers"),
    "float-dims": (_entry(0, "shape", [2.5]), "non-negative integers"),
    "bool-dims": (_entry(0, "shape", [True]), "non-negative integers"),
    "shape-not-list": (_entry(0, "shape", "16"), "non-negative integers"),
    "unknown-dtype": (_entry(0, "dtype", "F99"), "dtype"),
    "dtype-not-string": (_entry(0, "dtype", 32), "dtype"),
    "dtype-size-mismatch": (_wrong_dtype_size, "do not match shape"),
    "offsets-reversed": (_entry(0, "data_offsets", [64, 0]), "do not match"),
    "offsets-negative": (_entry(0, "data_offsets", [-64, 0]), "non-negative integers"),
    "offsets-three": (_entry(0, "data_offsets", [0, 1, 2]), "two non-negative integers"),
    "offsets-past-end": (_past_end, "ends at byte"),
    "entry-not-mapping": (lambda header, data: ({**header, "x": [1, 2]}, data), "not a mapping"),
    "entry-missing-keys": (lambda header, data: ({**header, "x": {"dtype": "F32"}}, data), "not a mapping"),
    "truncated": (lambda header, data: (header, data[: len(data) // 2]), "ends at byte"),
    "header-list": (lambda header, data: ([1, 2], data), "not a JSON object"),
}


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_bad_safetensors_header(source, tmp_path, capsys, command, case):
    change, needle = SAFETENSORS_CASES[case]
    src = copy_source(source, tmp_path)
    header, data = read_safetensors(src / "model.safetensors")
    header, data = change(header, data)
    write_safetensors(src / "model.safetensors", header, data)
    guard = Guard(src)
    args = ["convert", src, "--out", tmp_path / "out"] if command == "convert" else ["inspect", src]
    code, _, err = run_cli(capsys, *args)
    assert_refused(code, err, "model.safetensors", needle)
    guard.unchanged()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]


RAW_WEIGHT_CASES = {
    "empty-file": (b"", "too short"),
    "three-bytes": (b"abc", "too short"),
    "huge-header-length": (struct.pack("<Q", 2**60) + b"{}", "does not fit"),
    "header-not-json": (struct.pack("<Q", 10) + b"{not json}", "unreadable header"),
    "header-not-utf8": (struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc", "unreadable header"),
}


@pytest.mark.parametrize("case", list(RAW_WEIGHT_CASES))
def test_garbage_safetensors(source, tmp_path, capsys, case):
    content, needle = RAW_WEIGHT_CASES[case]
    src = copy_source(source, tmp_path)
    (src / "model.safetensors").write_bytes(content)
    refused_leaving_unchanged([src], capsys, "convert", src, "--out", tmp_path / "out", needle=needle)
    assert not (tmp_path / "out").exists()


def _sharded(source: Path, tmp_path: Path) -> Path:
    """The source as two safetensors shards with an index."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "sharded"
    src.mkdir()
    shutil.copyfile(source / "config.json", src / "config.json")
    state = load_file(source / "model.safetensors")
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({name: state[name] for name in shard_names}, src / shard, metadata={"format": "pt"})
        weight_map.update({name: shard for name in shard_names})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src


def _index_change(change):
    def apply(src: Path) -> None:
        index = json.loads((src / "model.safetensors.index.json").read_text())
        result = change(index)
        (src / "model.safetensors.index.json").write_text(json.dumps(index if result is None else result))
    return apply


def _first_shard(value):
    def change(index):
        first = sorted(index["weight_map"])[0]
        index["weight_map"][first] = value
    return change


def _duplicate_tensor(src: Path) -> None:
    from safetensors.torch import load_file, save_file

    first = src / "model-00001-of-00002.safetensors"
    second = load_file(src / "model-00002-of-00002.safetensors")
    name, value = next(iter(load_file(first).items()))
    save_file({**second, name: value}, src / "model-00002-of-00002.safetensors", metadata={"format": "pt"})


INDEX_CASES = {
    "tensor-in-two-shards": (_duplicate_tensor, "is in both"),
    "weight_map-list": (_index_change(lambda index: index.update(weight_map=[1, 2])), "must be a mapping"),
    "weight_map-string": (_index_change(lambda index: index.update(weight_map="x")), "must be a mapping"),
    "weight_map-missing": (_index_change(lambda index: index.pop("weight_map")), "must be a mapping"),
    "index-list": (_index_change(lambda index: [index]), "must hold a JSON object"),
    "shard-number": (_index_change(_first_shard(3)), "must be a file name"),
    "shard-parent": (_index_change(_first_shard("../model-00001-of-00002.safetensors")), "not a file name"),
    "shard-absolute": (_index_change(_first_shard("/etc/hostname")), "not a file name"),
    "shard-missing": (_index_change(_first_shard("model-00009-of-00009.safetensors")), "missing weight file"),
    "index-not-json": (lambda src: (src / "model.safetensors.index.json").write_text("{"), "cannot read"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_bad_index(source, tmp_path, capsys, case):
    change, needle = INDEX_CASES[case]
    src = _sharded(source, tmp_path)
    change(src)
    refused_leaving_unchanged([src], capsys, "convert", src, "--out", tmp_path / "out", needle=needle)
    assert not (tmp_path / "out").exists()


def test_shards_linked_outside_the_checkpoint_are_refused(source, tmp_path, capsys):
    """A shard that is a link resolving outside the checkpoint is refused in one line, like every
    other file normswap reads (the hub cache's links into its own blobs count as inside)."""
    src = _sharded(source, tmp_path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sorted(src.glob("*.safetensors")):
        shard.rename(blobs / shard.name)
        shard.symlink_to(blobs / shard.name)
    guard = Guard(src, blobs)
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--quiet")
    assert_refused(code, err, "outside")
    assert not (tmp_path / "out").exists()
    guard.unchanged()


def _bin(state) -> object:
    return state


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


BIN_CASES = {
    "int-value": (lambda state, marker: {**state, "extra": 3}, "not a tensor"),
    "string-value": (lambda state, marker: {**state, "extra": "x"}, "not a tensor"),
    "nested-dict": (lambda state, marker: {**state, "extra": {"a": torch.ones(1)}}, "not a tensor"),
    "int-key": (lambda state, marker: {**state, 3: torch.ones(1)}, "not a tensor"),
    "list": (lambda state, marker: list(state.values()), "does not hold a state dict"),
    "pickle-payload": (lambda state, marker: {**state, "extra": _Payload(marker)}, "other than tensors"),
}


@pytest.mark.parametrize("case", list(BIN_CASES))
def test_bad_bin(source, tmp_path, capsys, case):
    from safetensors.torch import load_file

    change, needle = BIN_CASES[case]
    src = tmp_path / "bin"
    src.mkdir()
    shutil.copyfile(source / "config.json", src / "config.json")
    marker = tmp_path / "payload-ran"
    torch.save(change(load_file(source / "model.safetensors"), marker), src / "pytorch_model.bin")
    guard = Guard(src)
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out")
    assert_refused(code, err, needle)
    assert not marker.exists()
    guard.unchanged()
    assert not (tmp_path / "out").exists()


def test_bin_garbage(source, tmp_path, capsys):
    src = tmp_path / "bin"
    src.mkdir()
    shutil.copyfile(source / "config.json", src / "config.json")
    (src / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out")
    assert_refused(code, err, "pytorch_model.bin")


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_truncated_bin(source, tmp_path, capsys, command):
    from safetensors.torch import load_file

    src = tmp_path / "bin"
    src.mkdir()
    shutil.copyfile(source / "config.json", src / "config.json")
    torch.save(load_file(source / "model.safetensors"), src / "pytorch_model.bin")
    data = (src / "pytorch_model.bin").read_bytes()
    (src / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(capsys, command, src, *(["--out", tmp_path / "out"] if command == "convert" else []))
    line = assert_refused(code, err, "pytorch_model.bin is truncated or corrupt")
    assert "advice" not in line and "high likelihood" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("call", ["convert", "rotate", "verify"])
@pytest.mark.parametrize("tolerance", [{"atol": math.nan}, {"rtol": -1.0}, {"atol": math.inf}, {"rtol": "1e-3"}])
def test_python_api_refuses_impossible_tolerances(source, converted, tmp_path, call, tolerance):
    from normswap.api import convert_checkpoint, rotate_checkpoint
    from normswap.verify.checkpoint import verify_checkpoint

    run = {
        "convert": lambda: convert_checkpoint(source, tmp_path / "out", **tolerance),
        "rotate": lambda: rotate_checkpoint(source, tmp_path / "out", **tolerance),
        "verify": lambda: verify_checkpoint(source, converted, **tolerance),
    }[call]
    wrong_type = any(isinstance(value, str) for value in tolerance.values())  # a wrong type is a TypeError
    with pytest.raises(TypeError if wrong_type else NormswapError,
                       match="must be float or None" if wrong_type else "must be a finite number >= 0"):
        run()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_untied_flag_without_a_head_is_refused(source, tmp_path, capsys, command):
    """tie_word_embeddings=false and no lm_head.weight: transformers would invent the head."""
    src = copy_source(source, tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    code, _, err = run_cli(capsys, command, src, *(["--out", tmp_path / "out", "--verify", "none"] if command == "convert" else []))
    assert_refused(code, err, "tie_word_embeddings=false", "lm_head.weight")
    assert not (tmp_path / "out").exists()


def test_eval_max_length_below_a_continuation_is_one_line(tmp_path):
    # a fresh process: --no-progress silences tqdm bars only where tqdm is not yet imported
    done = subprocess.run(
        [sys.executable, "-m", "normswap", "eval", "normswap:austen-gpt2", "--tasks", "persuasion_cloze",
         "--no-perplexity", "--limit", "3", "--max-length", "16", "--no-progress"],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert_refused(done.returncode, done.stderr, "--max-length")


def test_weights_file_is_a_folder(source, tmp_path, capsys):
    src = copy_source(source, tmp_path)
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").mkdir()
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out")
    assert_refused(code, err)
    assert not (tmp_path / "out").exists()


def test_missing_tensor(source, tmp_path, capsys):
    src = copy_source(source, tmp_path)
    header, data = read_safetensors(src / "model.safetensors")
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    del state["transformer.h.1.attn.c_attn.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--fold-gains")
    assert_refused(code, err, "transformer.h.1.attn.c_attn.weight")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", quick_first([math.nan, math.inf]))
def test_non_finite_weights_name_the_tensor(source, tmp_path, capsys, value):
    from safetensors.torch import load_file, save_file

    src = copy_source(source, tmp_path)
    state = load_file(src / "model.safetensors")
    state["transformer.h.0.mlp.c_fc.weight"][0, 0] = value
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    guard = Guard(src)
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--quiet")
    line = assert_refused(code, err, "transformer.h.0.mlp.c_fc.weight", "NaN or infinite")
    assert "tolerance nan" not in line
    guard.unchanged()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]


@pytest.mark.slow
def test_mixed_float16_float32_converts(source, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = copy_source(source, tmp_path)
    state = load_file(src / "model.safetensors")
    for name in list(state):
        if ".mlp." in name:
            state[name] = state[name].half()
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--quiet")
    assert code == 0, err


# ---------------------------------------------------------------------------------------------
# --out: never anything the user owns


def test_out_parent_of_source_with_overwrite(source, tmp_path, capsys):
    parent = tmp_path / "models"
    src = copy_source(source, parent)
    refused_leaving_unchanged([parent], capsys, "convert", src, "--out", parent, "--overwrite",
                              needle="contains the input")


@pytest.mark.parametrize("where", ["source", "inside", "deep-inside"])
def test_out_overlapping_source(source, tmp_path, capsys, where):
    src = copy_source(source, tmp_path)
    out = {"source": src, "inside": src / "out", "deep-inside": src / "a" / "b"}[where]
    refused_leaving_unchanged([src], capsys, "convert", src, "--out", out, "--overwrite", needle="input")


def test_out_is_current_folder(source, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = run_cli(capsys, "convert", source, "--out", ".")
    assert_refused(code, err, "current folder")
    assert list(work.iterdir()) == []
    code, _, err = run_cli(capsys, "convert", source, "--out", tmp_path, "--overwrite")
    assert_refused(code, err)
    assert (work.exists() and list(work.iterdir()) == [])


def test_out_is_root(source, capsys):
    code, _, err = run_cli(capsys, "convert", source, "--out", "/", "--overwrite")
    assert_refused(code, err, "root")


def test_user_folder_is_never_replaced(source, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    guard = Guard(out)
    for extra in ([], ["--overwrite"]):
        code, _, err = run_cli(capsys, "convert", source, "--out", out, *extra)
        assert_refused(code, err, "--overwrite")
    guard.unchanged()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine"]


def test_empty_user_folder_is_kept_and_filled(source, tmp_path, capsys, monkeypatch):
    """An empty --out the user made keeps its inode and mode (a private folder stays private); an
    install that fails part way moves its entries back, leaving the folder empty and kept."""
    from normswap.checkpoint import renames

    out = tmp_path / "private"
    out.mkdir(mode=0o700)
    before = os.stat(out)
    _fail_on(monkeypatch, renames, "_move", errno.EACCES, match=lambda args: args[1].name == "config.json")
    code, _, err = run_cli(capsys, "convert", source, "--out", out, "--quiet", "--verify", "none")
    assert_refused(code, err, "nothing was written")
    assert list(out.iterdir()) == [] and os.stat(out).st_ino == before.st_ino
    monkeypatch.undo()
    code, _, err = run_cli(capsys, "convert", source, "--out", out, "--quiet", "--verify", "none")
    assert code == 0, err
    after = os.stat(out)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert output.marked_kind(out) == "checkpoint" and (out / "model.safetensors").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["private"]


def test_marker_that_is_a_link_does_not_count(source, tmp_path, capsys, converted):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "data.txt").write_text("mine")
    (out / output.MARKER).symlink_to(converted / output.MARKER)
    refused_leaving_unchanged([out], capsys, "convert", source, "--out", out, "--overwrite",
                              needle="not written by normswap")


def test_out_is_a_file(source, tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("keep")
    code, _, err = run_cli(capsys, "convert", source, "--out", out, "--overwrite")
    assert_refused(code, err, "not a folder")
    assert out.read_text() == "keep"


def test_out_under_a_file(source, tmp_path, capsys):
    (tmp_path / "file").write_text("keep")
    code, _, err = run_cli(capsys, "convert", source, "--out", tmp_path / "file" / "out")
    assert_refused(code, err)
    assert (tmp_path / "file").read_text() == "keep"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("target", ["normswap-folder", "user-folder", "dangling"])
def test_symlinked_out_is_refused(source, tmp_path, capsys, converted, target):
    real = tmp_path / "real"
    if target == "normswap-folder":
        shutil.copytree(converted, real)
    elif target == "user-folder":
        real.mkdir()
        (real / "keep.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(real)
    refused_leaving_unchanged([tmp_path], capsys, "convert", source, "--out", link, "--overwrite",
                              needle="symbolic link")


@pytest.mark.slow
def test_overwrite_replaces_only_normswap_folders(source, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(source), "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / output.MARKER).read_text())["written_by"] == "normswap"
    first = (out / "config.json").read_bytes()
    code, _, err = run_cli(capsys, "convert", source, "--out", out, "--quiet")
    assert_refused(code, err, "--overwrite")
    assert main(["convert", str(source), "--out", str(out), "--overwrite", "--quiet"]) == 0
    assert (out / "config.json").read_bytes() == first
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_created_parents_are_removed_on_failure(source, tmp_path, capsys):
    out = tmp_path / "a" / "b" / "c" / "out"
    code, _, err = run_cli(capsys, "convert", source, "--out", out, "--atol", "0", "--rtol", "0", "--quiet")
    assert_refused(code, err, "verification failed", exit_code=3)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", quick_first([0o022, 0o002, 0o077]))
def test_output_follows_the_umask(source, tmp_path, umask):
    old = os.umask(umask)
    try:
        assert main(["convert", str(source), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    for path in (tmp_path / "out").iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name


def test_name_too_long(source, tmp_path, capsys):
    out = tmp_path / ("x" * 300)
    code, _, err = run_cli(capsys, "convert", source, "--out", out)
    assert_refused(code, err, "too long")
    assert list(tmp_path.iterdir()) == []


def _fail_on(monkeypatch, module, name: str, code: int, match=None):
    real = getattr(module, name)

    def failing(*args, **kwargs):
        if match is None or match(args):
            raise OSError(code, os.strerror(code), str(args[0]) if args else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


OS_ERROR_CASES = {
    "enospc-config": ("write_text", errno.ENOSPC, "config.json", "no space left"),
    "enospc-readme": ("write_text", errno.ENOSPC, "README.md", "no space left"),
    "enospc-modeling": ("write_bytes", errno.ENOSPC, "modeling_normswap.py", "no space left"),
    "enospc-marker": ("write_text", errno.ENOSPC, output.MARKER, "no space left"),
    "edquot-config": ("write_text", errno.EDQUOT, "config.json", "no space left"),
    "erofs-config": ("write_text", errno.EROFS, "config.json", "Read-only file system"),
    "eacces-readme": ("write_text", errno.EACCES, "README.md", "Permission denied"),
    "eio-readme": ("write_text", errno.EIO, "README.md", "Input/output error"),
}


@pytest.mark.parametrize("case", quick_first(list(OS_ERROR_CASES)))
def test_os_errors_while_writing(source, tmp_path, capsys, monkeypatch, case):
    method, code_, file_name, needle = OS_ERROR_CASES[case]
    real = getattr(Path, method)

    def failing(self, *args, **kwargs):
        if self.name == file_name:
            raise OSError(code_, os.strerror(code_), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, method, failing)
    code, _, err = run_cli(capsys, "convert", source, "--out", tmp_path / "sub" / "out", "--quiet")
    assert_refused(code, err, needle, "nothing was written")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code_", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_os_errors_creating_out(source, tmp_path, capsys, monkeypatch, code_):
    _fail_on(monkeypatch, os, "mkdir", code_)
    code, _, err = run_cli(capsys, "convert", source, "--out", tmp_path / "out", "--quiet")
    assert_refused(code, err, "nothing was written")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code_", quick_first([errno.EBUSY, errno.EXDEV, errno.EACCES]))
def test_os_errors_at_install(source, tmp_path, capsys, monkeypatch, code_):
    _fail_on(monkeypatch, os, "rename", code_)
    code, _, err = run_cli(capsys, "convert", source, "--out", tmp_path / "out", "--quiet")
    assert_refused(code, err, os.strerror(code_), "nothing was written")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_before_writing_says_how_much(source, tmp_path, capsys, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    code, _, err = run_cli(capsys, "convert", source, "--out", tmp_path / "out", "--quiet")
    line = assert_refused(code, err, "not enough disk space", "kB")
    assert "0.00 GB" not in line
    assert list(tmp_path.iterdir()) == []


def test_enospc_while_writing_weights(source, tmp_path, capsys, monkeypatch):
    _fail_on(monkeypatch, os, "pwrite", errno.ENOSPC)
    code, _, err = run_cli(capsys, "convert", source, "--out", tmp_path / "out", "--quiet")
    assert_refused(code, err, "no space left")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# claims: concurrency, things appearing at --out, stale temporary folders


def test_second_claimant_is_refused(source, tmp_path, capsys):
    out = tmp_path / "out"
    with output.claimed_output(out, inputs=[source], overwrite=False, kind="checkpoint"):
        code, _, err = run_cli(capsys, "convert", source, "--out", out, "--quiet")
        assert_refused(code, err, "another normswap process")
    assert sorted(path.name for path in tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", quick_first(["file-added", "folder-replaced", "folder-removed"]))
def test_something_appears_at_out_during_conversion(source, tmp_path, capsys, monkeypatch, how):
    from normswap.convert import install as pipeline

    out = tmp_path / "out"
    real_write = pipeline.write_weights

    def write_and_interfere(*args, **kwargs):
        real_write(*args, **kwargs)
        if how == "file-added":
            (out / "notes.txt").write_text("written meanwhile")
        elif how == "folder-replaced":
            out.rmdir()
            out.mkdir()
            (out / "notes.txt").write_text("written meanwhile")
        else:
            out.rmdir()

    monkeypatch.setattr(pipeline, "write_weights", write_and_interfere)
    code, _, err = run_cli(capsys, "convert", source, "--out", out, "--quiet")
    if how == "folder-removed":
        assert_refused(code, err, "replaced")
        assert list(tmp_path.iterdir()) == []
        return
    assert_refused(code, err, "while normswap worked")
    assert (out / "notes.txt").read_text() == "written meanwhile"
    assert sorted(path.name for path in out.iterdir()) == ["notes.txt"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.slow
def test_stale_temporary_folder_is_removed(source, tmp_path, capsys):
    stale = tmp_path / f"out{temporaries.TMP_TAG}{_dead_pid()}-0-deadbeef"
    stale.mkdir()
    (stale / temporaries.TMP_MARKER).write_text("deadbeef\n")
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    live = tmp_path / f"out{temporaries.TMP_TAG}{os.getpid()}-{temporaries.process_start(os.getpid())}-cafecafe"
    live.mkdir()
    other = tmp_path / f"other{temporaries.TMP_TAG}{_dead_pid()}-0-deadbeef"
    other.mkdir()
    code, _, err = run_cli(capsys, "convert", source, "--out", tmp_path / "out", "--quiet")
    assert code == 0, err
    assert "removed" in err and stale.name in err and "no longer runs" in err
    assert not stale.exists() and live.exists() and other.exists()


@pytest.mark.slow
def test_concurrent_conversions_one_wins(source, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "normswap.cli", "convert", str(source), "--out", str(out), "--quiet"]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    results = [(process.wait(timeout=300), process.stderr.read()) for process in processes]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code != 0)
    assert_refused(2, loser, exit_code=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_killed_conversion_is_cleaned_by_the_next(source, tmp_path):
    """SIGKILL leaves the temporary folder (and a claimed, empty --out); the next run cleans up."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = (
        "import sys, signal, os\n"
        "from normswap.convert import install as pipeline\n"
        "real = pipeline.write_weights\n"
        "def write(*a, **k):\n"
        "    real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "pipeline.write_weights = write\n"
        "from normswap.cli import main\n"
        f"main(['convert', {str(source)!r}, '--out', {str(out)!r}, '--quiet'])\n"
    )
    process = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert process.returncode == -9
    left = sorted(path.name for path in tmp_path.iterdir())
    assert "out" in left and any(temporaries.TMP_TAG in name for name in left)
    assert main(["convert", str(source), "--out", str(out), "--quiet"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1"])
def test_an_interrupting_signal_leaves_nothing(source, tmp_path, name):
    """Every signal that ends a process by default and stops a command (a closed terminal sends
    SIGHUP) is an interrupt: one line, exit 130, nothing left."""
    out = tmp_path / "deep" / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = (
        "import os, signal\n"
        "from normswap.convert import install as pipeline\n"
        "real = pipeline.write_weights\n"
        "def write(*a, **k):\n"
        "    real(*a, **k)\n"
        f"    os.kill(os.getpid(), signal.{name})\n"
        "pipeline.write_weights = write\n"
        "from normswap.cli import main\n"
        f"raise SystemExit(main(['convert', {str(source)!r}, '--out', {str(out)!r}, '--quiet']))\n"
    )
    process = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert process.returncode == 130
    assert_refused(130, process.stderr, "interrupted", exit_code=130)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# verify: no code from the checkpoint runs; malformed checkpoints are one line


def _converted_copy(converted: Path, tmp_path: Path) -> Path:
    target = tmp_path / "conv"
    shutil.copytree(converted, target)
    return target


def test_verify_refuses_and_runs_no_checkpoint_code(source, converted, tmp_path, capsys):
    conv = _converted_copy(converted, tmp_path)
    marker = tmp_path / "ran"
    # a code file beside the weights, and an auto_map naming it
    (conv / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    edit_config(conv, lambda config: config["auto_map"].update(
        {key: "evil.Anything" for key in config["auto_map"]}))
    code, _, err = run_cli(capsys, "verify", source, conv, "--quiet")
    assert_refused(code, err, "auto_map", exit_code=3)
    assert not marker.exists()


def test_verify_refuses_tampered_modeling_file(source, converted, tmp_path, capsys):
    conv = _converted_copy(converted, tmp_path)
    marker = tmp_path / "ran"
    with open(conv / "modeling_normswap.py", "a") as file:
        file.write(f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    guard = Guard(conv, source)
    code, _, err = run_cli(capsys, "verify", source, conv, "--quiet")
    assert_refused(code, err, "modeling_normswap.py", "changed after conversion", exit_code=3)
    assert not marker.exists()
    guard.unchanged()


def test_load_runs_no_checkpoint_code(converted, tmp_path):
    import normswap

    conv = _converted_copy(converted, tmp_path)
    marker = tmp_path / "ran"
    with open(conv / "modeling_normswap.py", "a") as file:
        file.write(f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    model = normswap.load(conv)
    assert any(getattr(module, "is_normswap_rmsnorm", False) for module in model.modules())
    assert not marker.exists()


def test_verify_trust_remote_code_runs_the_file(source, converted, tmp_path, capsys):
    conv = _converted_copy(converted, tmp_path)
    code, stdout, err = run_cli(capsys, "verify", source, conv, "--quiet", "--trust-remote-code")
    assert code == 0, err


BLOCK_CASES = {
    "list": (lambda block: [block], "is not a mapping"),
    "string": (lambda block: "x", "is not a mapping"),
    "options-string": (lambda block: {**block, "options": "exact"}, "'options' must be a mapping"),
    "method-unknown": (lambda block: {**block, "options": {**block["options"], "method": "magic"}}, "options.method"),
    "dtype-unknown": (lambda block: {**block, "options": {**block["options"], "dtype": "int3"}}, "options.dtype"),
    "stock-loadable-string": (lambda block: {**block, "stock_loadable": "yes"}, "'stock_loadable'"),
    "structure-list": (lambda block: {**block, "structure": ["x"]}, "'structure'"),
    "structure-values": (lambda block: {**block, "structure": {"identity": "x"}}, "structure.identity"),
    "original-type-number": (lambda block: {**block, "original_model_type": 3}, "'original_model_type'"),
    "hash-number": (lambda block: {**block, "modeling_sha256": 3}, "'modeling_sha256'"),
    "wrong-family": (lambda block: {**block, "original_model_type": "opt"}, "converted from a opt model"),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_verify_malformed_block(source, converted, tmp_path, capsys, case):
    change, needle = BLOCK_CASES[case]
    conv = _converted_copy(converted, tmp_path)
    edit_config(conv, lambda config: config.update(normswap=change(config["normswap"])) and None)
    refused_leaving_unchanged([conv], capsys, "verify", source, conv, "--quiet", needle=needle)


@pytest.mark.parametrize("role", ["original", "converted"])
@pytest.mark.parametrize("case", ["n_layer-5000", "n_embd-string", "n_head-indivisible", "list"])
def test_verify_bad_config(source, converted, tmp_path, capsys, role, case):
    change, needle = CONFIG_CASES[case]
    src, conv = copy_source(source, tmp_path), _converted_copy(converted, tmp_path)
    edit_config(src if role == "original" else conv, change)
    refused_leaving_unchanged([tmp_path], capsys, "verify", src, conv, "--quiet", needle=needle)


def test_verify_without_modeling_file(source, converted, tmp_path, capsys):
    conv = _converted_copy(converted, tmp_path)
    (conv / "modeling_normswap.py").unlink()
    code, _, err = run_cli(capsys, "verify", source, conv, "--quiet")
    assert_refused(code, err, "has no modeling_normswap.py", exit_code=3)


def test_verify_arguments_swapped(source, converted, capsys):
    code, _, err = run_cli(capsys, "verify", converted, source, "--quiet")
    assert_refused(code, err, "converted checkpoint", "swapped")
    code, _, err = run_cli(capsys, "verify", converted, converted, "--quiet")
    assert_refused(code, err, "verify takes the original first")


def test_verify_missing_and_non_checkpoint(source, tmp_path, capsys):
    code, _, err = run_cli(capsys, "verify", source, tmp_path / "nothing", "--quiet")
    assert_refused(code, err, "does not exist")
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, "verify", source, tmp_path / "empty", "--quiet")
    assert_refused(code, err, "no config.json")
    code, _, err = run_cli(capsys, "verify", source, source, "--quiet")
    assert_refused(code, err, "not a normswap checkpoint")


def test_verify_out_that_is_a_file(source, converted, tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    code, _, err = run_cli(capsys, "verify", source, converted, "--quiet", "--out", tmp_path / "a-file")
    assert_refused(code, err, "is not a folder")
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"] and (tmp_path / "a-file").read_text() == "mine"


def test_verify_names_non_finite_tensor(source, converted, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    conv = _converted_copy(converted, tmp_path)
    state = load_file(conv / "model.safetensors")
    state["transformer.h.1.mlp.c_proj.weight"][0, 0] = math.nan
    save_file(state, conv / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "verify", source, conv, "--quiet")
    # a converted tensor that differs from what the conversion makes fails the proof (exit 3)
    assert_refused(code, err, "transformer.h.1.mlp.c_proj.weight", "nan", exit_code=3)


@pytest.mark.parametrize("command", ["eval", "geometry"])
@pytest.mark.parametrize("case", ["n_embd-string", "n_layer-5000", "null", "architectures-other-family"])
def test_eval_and_geometry_bad_config(source, tmp_path, capsys, command, case):
    change, needle = CONFIG_CASES[case]
    src = copy_source(source, tmp_path)
    edit_config(src, change)
    refused_leaving_unchanged([tmp_path], capsys, command, src, "--no-progress" if command == "eval" else "--random-tokens",
                              needle=needle)


def test_inspect_refusal_is_stderr_exit_2(tmp_path, capsys):
    src = tmp_path / "bert"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (src / "model.safetensors").write_bytes(b"")
    code, stdout, err = run_cli(capsys, "inspect", src)
    assert_refused(code, err, "post-LN")
    assert stdout == ""


# ---------------------------------------------------------------------------------------------
# run: recipe names, --out, YAML tags


def _recipe(tmp_path: Path, source: Path, **extra) -> Path:
    import yaml

    data = {"source": str(source), "eval": {"tasks": [], "perplexity": False}, **extra}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", ["/etc", "../escape", "a/b", ".", "..", "", "~user", "x" * 200, 7])
def test_recipe_name_must_be_plain(source, tmp_path, capsys, name):
    recipe = _recipe(tmp_path, source, name=name)
    guard = Guard(tmp_path)
    code, _, err = run_cli(capsys, "run", recipe, "--out", tmp_path / "run")
    if name == "":
        # an empty name falls back to the file's name; that run goes ahead (and is not asserted here)
        return
    assert_refused(code, err, "'name' must be a plain name")
    guard.unchanged()


def test_run_out_parent_of_source(source, tmp_path, capsys):
    parent = tmp_path / "models"
    src = copy_source(source, parent)
    recipe = _recipe(tmp_path, src)
    refused_leaving_unchanged([tmp_path], capsys, "run", recipe, "--out", parent, "--overwrite",
                              needle="contains the input")


def test_run_out_containing_the_recipe(source, tmp_path, capsys):
    folder = tmp_path / "recipes"
    folder.mkdir()
    recipe = _recipe(folder, source)
    refused_leaving_unchanged([tmp_path], capsys, "run", recipe, "--out", folder, "--overwrite",
                              needle="input")


def test_run_user_folder_never_replaced(source, tmp_path, capsys):
    recipe = _recipe(tmp_path, source)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused_leaving_unchanged([tmp_path], capsys, "run", recipe, "--out", out, "--overwrite",
                              needle="not written by normswap")


def test_failed_run_leaves_nothing(source, tmp_path, capsys):
    recipe = _recipe(tmp_path, source, verify={"atol": 0.0, "rtol": 0.0})
    guard = Guard(tmp_path)
    code, _, err = run_cli(capsys, "run", recipe, "--out", tmp_path / "runs" / "x", "--no-progress")
    lines = [line for line in err.splitlines() if "error" in line]
    assert code == 3 and len(lines) == 1 and "Traceback" not in err
    guard.unchanged()


@pytest.mark.parametrize("tag", [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
    "!!python/name:os.system",
])
def test_recipe_yaml_tags_never_run(source, tmp_path, capsys, tag):
    marker = tmp_path / "ran"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"source: {source}\ndescription: {tag.format(marker=marker)}\n")
    code, _, err = run_cli(capsys, "run", recipe, "--out", tmp_path / "run")
    assert_refused(code, err, "not valid YAML")
    assert not marker.exists()
    assert not (tmp_path / "run").exists()


def test_lm_eval_git_probe_is_silenced():
    from lm_eval import evaluator

    from normswap.evaluation.lmeval import _no_git_probe

    original = evaluator.get_git_commit_hash
    with _no_git_probe():
        assert evaluator.get_git_commit_hash() is None
    assert evaluator.get_git_commit_hash is original


# ---------------------------------------------------------------------------------------------
# hub ids


def test_offline_hub_message_is_whole(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(capsys, "convert", "openai-community/gpt2-medium", "--out", tmp_path / "out")
    line = assert_refused(code, err, "could not fetch", "offline", "local checkpoint directory")
    assert line.endswith("instead")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- found in review


def test_eval_out_never_replaces_a_users_folder(source, tmp_path, capsys):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "report.md").write_text("precious")
    code, _, err = run_cli(capsys, "eval", source, "--no-perplexity", "--tasks", "x", "--out", users)
    assert_refused(code, err, "not empty")
    assert (users / "report.md").read_text() == "precious"
    code, _, err = run_cli(capsys, "eval", source, "--no-perplexity", "--tasks", "x", "--out", users, "--overwrite")
    assert_refused(code, err, "normswap")
    assert (users / "report.md").read_text() == "precious"


def test_eval_out_may_not_lie_in_the_model(source, capsys):
    before = tree_hashes(source)
    code, _, err = run_cli(capsys, "eval", source, "--no-perplexity", "--tasks", "x", "--out", source / "reports")
    assert_refused(code, err, "input")
    assert tree_hashes(source) == before


@pytest.mark.parametrize("args, needle", [
    (["eval", "{src}", "--device", "tpu9"], "not a torch device"),
    (["geometry", "{src}", "--device", "tpu9"], "not a torch device"),
    (["eval", "{src}", "--threads", "1000000"], "--threads must be between 1 and"),
    (["geometry", "{src}", "--random-tokens", "--plot"], "--plot needs --out"),
    (["eval", "{src}", "--plot"], "--plot needs --out"),
])  # fmt: skip
def test_options_checked_before_work(source, tmp_path, capsys, args, needle):
    code, _, err = run_cli(capsys, *[a.format(src=source, tmp=tmp_path) for a in args])
    assert_refused(code, err, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["eval", "x", "--threads", "abc"], ["rotate", "x", "--out", "y", "--method", "bogus"], []])
def test_argument_errors_are_one_line(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "error:" in err and "usage" not in err


def test_geometry_compare_of_another_shape_is_refused(source, tmp_path, capsys):
    code, _, err = run_cli(capsys, "geometry", "normswap:austen-gpt2", "--compare", source, "--random-tokens")
    assert_refused(code, err, "was not converted from")


@pytest.mark.parametrize("value", quick_first(["nan", "inf", "-1", "1e400", "tight"]))
@pytest.mark.parametrize("command", ["convert", "rotate", "verify"])
def test_tolerance_must_be_a_finite_non_negative_number(tmp_path, capsys, command, value):
    out = tmp_path / "out"
    args = {"convert": ("convert", "normswap:austen-gpt2", "--out", str(out)),
            "rotate": ("rotate", "normswap:austen-gpt2", "--out", str(out)),
            "verify": ("verify", "normswap:austen-gpt2", str(tmp_path))}[command]
    for option in ("--atol", "--rtol"):
        with pytest.raises(SystemExit) as exit_info:  # argparse's own refusal, in normswap's one-line form
            main([*args, option, value])
        line = assert_refused(exit_info.value.code, capsys.readouterr().err, option, "tolerance")
        assert value in line
    assert not out.exists() and not leftovers(tmp_path)


@pytest.mark.parametrize(("option", "value"), [("--out", ""), ("--out", "  "), ("--revision", "")])
def test_empty_names_are_refused(tmp_path, capsys, option, value):
    args = ["convert", "some-org/some-model", "--out", str(tmp_path / "out"), option, value]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert_refused(exit_info.value.code, capsys.readouterr().err, option, "must not be empty")
    assert not (tmp_path / "out").exists()


BUNDLED = Path(__file__).resolve().parents[1] / "normswap" / "data" / "austen-gpt2"


def test_side_files_drop_code_they_would_name(tmp_path, capsys):
    source = copy_source(BUNDLED, tmp_path)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "auto_map": {"AutoTokenizer": ["evil.T", None]}}))
    (source / "evil.py").write_text("raise SystemExit('ran')\n")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", str(source), "--out", str(out), "--verify", "none", "--quiet")
    assert code == 0, err
    assert json.loads((out / "tokenizer_config.json").read_text()) == tokenizer_config
    assert not (out / "evil.py").exists()


def test_save_never_writes_into_the_original(tmp_path):
    import normswap
    from normswap.errors import NormswapError

    source = copy_source(BUNDLED, tmp_path)
    before = tree_hashes(source)
    model = GPT2LMHeadModel.from_pretrained(source)
    with pytest.raises(NormswapError, match="input"):
        normswap.save(normswap.convert_model(model), source / "converted")
    assert tree_hashes(source) == before


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("eval", "normswap:austen-gpt2", "--tasks", "local", "--limit", "inf"), "--limit"),
        (("eval", "normswap:austen-gpt2", "--tasks", "local", "--limit", "nan"), "--limit"),
        (("eval", "normswap:austen-gpt2", "--ppl-rtol", "nan"), "--ppl-rtol"),
        (("eval", "normswap:austen-gpt2", "--acc-atol", "-1"), "--acc-atol"),
        (("eval", "normswap:austen-gpt2", "--doc-ll-atol", "inf"), "--doc-ll-atol"),
        (("geometry", "normswap:austen-gpt2", "--batch-size", "0"), "--batch-size"),
        (("geometry", "normswap:austen-gpt2", "--seq-len", "0"), "--seq-len"),
        (("geometry", "normswap:austen-gpt2", "--top-dims", "-1"), "--top-dims"),
        (("geometry", "normswap:austen-gpt2", "--seq-len", "257"), "context"),
        (("inspect", "normswap:austen-gpt2", "--bogus"), "normswap inspect: error: unrecognized arguments: --bogus"),
    ],
)
def test_impossible_numbers_are_refused_before_any_work(capsys, args, needle):
    try:
        code = main(list(args))
    except SystemExit as exit_info:  # argparse's refusal, in normswap's one-line form
        code = exit_info.code
    assert_refused(code, capsys.readouterr().err, needle)


@pytest.mark.parametrize("mode, needle", [("--full", "rerun with --verify layerwise"), ("--layerwise", "worst block ")])
def test_failed_verify_names_the_block_or_how_to_find_it(source, converted, tmp_path, capsys, mode, needle):
    """A faithful conversion held to a zero tolerance: the weights proof and the contents checks
    pass, float32 rounding fails the comparison, and the one error line says where to look."""
    code, _, err = run_cli(capsys, "verify", source, converted, mode, "--atol", "0", "--rtol", "0", "--quiet")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 3 and "Traceback" not in err
    assert "does not match the original within tolerance" in lines[-1] and needle in lines[-1]
