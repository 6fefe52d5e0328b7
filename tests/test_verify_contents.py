"""verify holds everything a converted folder holds to what normswap writes for its original: the
modeling file and auto_map (whatever config.json records), config.json key by key, the normswap
block's keys the plan settles, the side files, no second set of weights and nothing else, and a
tolerance from the stored dtypes, not from the recorded label. Every tampered copy fails in one
line before any model runs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import deep_tree
from test_hostile import assert_refused, run_cli

from normswap.checkpoint.provenance import Provenance
from normswap.checkpoint.source import read_config, resolve_source
from normswap.cli import main
from normswap.errors import VerificationError
from normswap.verify import contents

ORIGINAL = "normswap:austen-gpt2"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The bundled model converted once (convert verifies it), never modified by any test."""
    out = tmp_path_factory.mktemp("contents") / "rms"
    assert main(["convert", ORIGINAL, "--out", str(out), "--quiet"]) == 0
    return out


def tampered(converted: Path, tmp_path: Path, change: Callable[[Path], None]) -> Path:
    folder = tmp_path / "tampered"
    shutil.copytree(converted, folder)
    change(folder)
    return folder


def edit_json(name: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        edit(data)
        (folder / name).write_text(json.dumps(data))
    return change


def refused(capsys, folder: Path, *needles: str) -> str:
    code, _, err = run_cli(capsys, "verify", ORIGINAL, folder)
    return assert_refused(code, err, *needles, exit_code=3)


def test_genuine_conversion_holds_what_normswap_writes(converted):
    original = resolve_source(ORIGINAL)
    config = read_config(converted)
    contents.check_contents(original, converted, read_config(original), config, Provenance.of(config, converted))
    assert contents.stored_dtype(converted, Provenance.of(config, converted)) == "float32"


def test_replaced_modeling_file_fails_whatever_the_recorded_hash(converted, tmp_path, capsys):
    def replace(folder: Path) -> None:
        file = folder / "modeling_normswap.py"
        file.write_text(file.read_text() + "\nimport os\n")
        edit_json("config.json", lambda c: c["normswap"].update(modeling_sha256=hashlib.sha256(
            file.read_bytes()).hexdigest()))(folder)
    refused(capsys, tampered(converted, tmp_path, replace), "modeling_normswap.py differs from the file normswap writes")


@pytest.mark.parametrize("auto_map", [{"AutoModelForCausalLM": "evil.Evil"}, None, {}])
def test_auto_map_must_be_what_normswap_writes(converted, tmp_path, capsys, auto_map):
    def change(config: dict) -> None:
        if auto_map is None:
            config["auto_map"]["AutoModel"] = "evil.Evil"
        else:
            config["auto_map"] = auto_map
    refused(capsys, tampered(converted, tmp_path, edit_json("config.json", change)), "'auto_map'")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model-extra.safetensors", "weights/model.gguf"])
def test_second_set_of_weights_fails(converted, tmp_path, capsys, name):
    def add(folder: Path) -> None:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(b"weights")
    refused(capsys, tampered(converted, tmp_path, add), name, "weight file normswap did not write")


@pytest.mark.parametrize("name", ["tokenization_extra.py", "custom_generate/generate.py", "notes.txt"])
def test_files_normswap_does_not_write_fail(converted, tmp_path, capsys, name):
    def add(folder: Path) -> None:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text("print('extra')\n")
    refused(capsys, tampered(converted, tmp_path, add), repr(name.split("/")[0]), "normswap does not write")


@pytest.mark.parametrize("kind", ["fifo", "link-outside"])
def test_what_normswap_writes_is_a_regular_file_inside_the_checkpoint(converted, tmp_path, capsys, kind):
    def change(folder: Path) -> None:
        (folder / "README.md").unlink()
        if kind == "fifo":
            os.mkfifo(folder / "README.md")
        else:
            (tmp_path / "outside.md").write_text("card\n")
            (folder / "README.md").symlink_to(tmp_path / "outside.md")
    code, _, err = run_cli(capsys, "verify", ORIGINAL, tampered(converted, tmp_path, change))
    assert_refused(code, err, "README.md", exit_code=2)  # read as side files are: bad input


def test_no_folder_tree_stops_the_check(converted, tmp_path, capsys):
    folder = tampered(converted, tmp_path, lambda folder: None)
    with deep_tree(folder / "d"):
        code, _, err = run_cli(capsys, "verify", ORIGINAL, folder)
    assert_refused(code, err, "'d', a folder", exit_code=3)


def test_hidden_entries_are_left_alone(converted, tmp_path):
    """A hub repository's ``.gitattributes`` and a clone's ``.git`` are not the model's files."""
    def add(folder: Path) -> None:
        (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
        (folder / ".git").mkdir()
        (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    folder = tampered(converted, tmp_path, add)
    contents.check_other_files(folder)


@pytest.mark.parametrize(("key", "edit"), [
    ("norms_swapped", lambda block: block["norms_swapped"].pop()),
    ("norms_folded", lambda block: block["norms_folded"].append("transformer.ln_f")),
    ("writers_centred", lambda block: block.update(writers_centred=block["writers_centred"] - 1)),
    ("untied", lambda block: block["untied"].append("transformer.wte.weight")),
    ("comment", lambda block: block.update(comment="hi")),
    ("options.zzz", lambda block: block["options"].update(zzz=1)),
])
def test_the_normswap_block_states_what_the_conversion_did(converted, tmp_path, capsys, key, edit):
    folder = tampered(converted, tmp_path, edit_json("config.json", lambda config: edit(config["normswap"])))
    refused(capsys, folder, f"'normswap.{key}'")


@pytest.mark.parametrize(("name", "change"), [
    ("tokenizer.json", edit_json("tokenizer.json", lambda t: t["model"]["vocab"].update(
        {"!": t["model"]["vocab"]['"'], '"': t["model"]["vocab"]["!"]}))),
    ("generation_config.json", edit_json("generation_config.json", lambda g: g.update(repetition_penalty=5))),
    ("tokenizer_config.json", lambda folder: (folder / "tokenizer_config.json").unlink()),
    ("vocab.txt", lambda folder: (folder / "vocab.txt").write_text("a\n")),
])
def test_side_files_must_be_the_originals(converted, tmp_path, capsys, name, change):
    refused(capsys, tampered(converted, tmp_path, change), name)


def test_side_file_json_compared_without_auto_map(converted, tmp_path):
    original = tmp_path / "original"
    shutil.copytree(resolve_source(ORIGINAL), original)
    edit_json("tokenizer_config.json", lambda t: t.update(auto_map={"AutoTokenizer": ["x.Tok", None]}))(original)
    copy = tampered(converted, tmp_path, edit_json("tokenizer_config.json", lambda t: None))  # reformatted
    contents.check_side_files(original, copy)


@pytest.mark.parametrize(("key", "edit"), [
    ("activation_function", lambda c: c.update(activation_function="gelu")),
    ("layer_norm_epsilon", lambda c: c.pop("layer_norm_epsilon")),
    ("sliding_window", lambda c: c.update(sliding_window=17)),
    ("tie_word_embeddings", lambda c: c.update(tie_word_embeddings=True)),
    ("model_type", lambda c: c.update(model_type="normswap_gpt2")),
    ("architectures", lambda c: c.update(architectures=["GPT2Model"])),
    ("dtype", lambda c: c.update(dtype="bfloat16")),
])
def test_config_must_be_the_originals_but_for_what_normswap_rewrites(converted, tmp_path, capsys, key, edit):
    refused(capsys, tampered(converted, tmp_path, edit_json("config.json", edit)), repr(key))


def test_tolerance_follows_stored_dtype_not_the_label(converted, tmp_path, capsys):
    folder = tampered(converted, tmp_path, edit_json("config.json", lambda c: c["normswap"]["options"].update(
        dtype="bfloat16")))
    refused(capsys, folder, "normswap.options.dtype", "stored as float32")
    config = read_config(folder)
    config["normswap"]["options"].pop("dtype")
    with pytest.raises(VerificationError):
        contents.stored_dtype(folder, Provenance.of(read_config(folder), folder))
    assert contents.stored_dtype(folder, Provenance.of(config, folder)) == "float32"
