"""The typed provenance view (every field it exposes checked), and each config.json read once per command.

Following a checkpoint through ``verify`` (whole and layer by layer) and through ``rotate`` (write,
then verify what was written), normswap parses each config.json once and passes it down.
"""

from __future__ import annotations

import collections
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import save

from normswap.checkpoint import source
from normswap.checkpoint.provenance import STRUCTURE_KINDS, Provenance, family_config, original_model_type
from normswap.cli import main
from normswap.errors import NormswapError

BUNDLED = Path(source.__file__).parents[1] / "data"
CALIBRATION = BUNDLED / "text" / "emma-excerpt.txt"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("provenance")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=2048, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    src = save(transformers.GPT2LMHeadModel(config).eval(), root / "src")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # pca reads its calibration text with it
        shutil.copyfile(BUNDLED / "austen-gpt2" / name, src / name)
    assert main(["convert", str(src), "--out", str(root / "converted"), "--quiet", "--verify", "none"]) == 0
    return src, root / "converted"


def _counted_reads(monkeypatch) -> collections.Counter:
    """Count calls of ``source.read_config`` per folder, wherever a module has bound the name."""
    reads: collections.Counter = collections.Counter()
    reader = source.read_config

    def counted(path: Path) -> dict:
        reads[Path(path).name.split(".normswap-tmp")[0]] += 1
        return reader(path)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("normswap") and getattr(module, "read_config", None) is reader:
            monkeypatch.setattr(module, "read_config", counted)
    return reads


@pytest.mark.parametrize("argv", [["verify", "{src}", "{converted}"], ["verify", "{src}", "{converted}", "--layerwise"],
                                  ["rotate", "{src}", "--out", "{out}", "--quiet"],
                                  ["rotate", "{src}", "--out", "{out}", "--quiet", "--method", "pca", "--calibration",
                                   str(CALIBRATION)]], ids=["verify", "layerwise", "rotate", "rotate-pca"])
def test_each_config_is_read_once_per_command(pair, tmp_path, monkeypatch, capsys, argv):
    import normswap.api  # noqa: F401  (every module the commands reach is imported before counting)
    import normswap.verify.checkpoint  # noqa: F401

    src, converted = pair
    reads = _counted_reads(monkeypatch)
    names = {"src": src, "converted": converted, "out": tmp_path / "rotated"}
    assert main([part.format(**names) for part in argv]) == 0, capsys.readouterr().err
    assert reads and max(reads.values()) == 1, dict(reads)


def test_provenance_view(pair, tmp_path):
    src, converted = pair
    config = source.read_config(converted)
    provenance = Provenance.of(config, converted)
    assert provenance.original_model_type == "gpt2" == original_model_type(config)
    assert provenance.method == "exact" and provenance.rotation is None and provenance.slicing is None
    assert family_config(config)["model_type"] == "gpt2"
    assert Provenance.of(source.read_config(src), src) is None
    with pytest.raises(NormswapError, match="'options' must be a mapping"):
        Provenance.of({"normswap": {"options": [1]}}, tmp_path)


GOOD_ROTATION = {"method": "hadamard", "seed": 0, "dimension": 32, "construction": "diag(±1)·H/√d",
                 "matrix_sha256": "0" * 64, "matrix_file": "normswap_rotation.record", "form": "commuting",
                 "centred": False, "fixed_streams": {}, "rotated_outputs": {}, "rotated": {"writers": 3}}
GOOD_SLICING = {"hidden_size": 24, "original_hidden_size": 32, "blocks": "transformer.h",
                "stream_axes": [["transformer\\.wte\\.weight", 1]], "branches": [["ln_1", "attn"]]}


def _block(rotation: dict | None = None, slicing: dict | None = None, **top) -> dict:
    block = {"options": {"method": "exact"}, **top}
    if rotation is not None:
        block["rotation"] = {**GOOD_ROTATION, **rotation}
    if slicing is not None:
        block["slicing"] = {**GOOD_SLICING, **slicing}
    return {"model_type": "gpt2", "n_embd": 32, "normswap": block}


@pytest.mark.parametrize("config, needle", [
    *[(_block({"seed": seed}), "rotation.seed must be") for seed in ("x", 1e308, 10**30, True, -1, None)],
    (_block({"method": "pca", "seed": 3}), "rotation.seed must be null"),
    *[(_block({"method": method}), "rotation.method must be") for method in ("bogus", None, ["hadamard"])],
    *[(_block({"rotated_outputs": value}), "rotation.rotated_outputs must be") for value in ("logits", [1, 2])],
    (_block({"fixed_streams": [1]}), "rotation.fixed_streams must be"),
    *[(_block({"matrix_file": name}), "rotation.matrix_file must be") for name in ("../../etc/passwd", "q.pt", 1)],
    *[(_block({"dimension": value}), "rotation.dimension must be") for value in (64, 0, "32", True)],
    (_block({"matrix_sha256": "abc"}), "rotation.matrix_sha256 must be"),
    (_block({"form": "loose"}), "rotation.form must be"),
    (_block({"centred": "yes"}), "rotation.centred must be"),
    (_block({"rotated": {"writers": "3"}}), "rotation.rotated must be"),
    (_block(writers_centred=-5), "writers_centred must be a count"),
    (_block(writers_centred=True), "writers_centred must be a count"),
    (_block(structure={"bogus_kind": ["x"]}), "unknown kind 'bogus_kind'"),
    (_block(structure={"identity": "x"}), "structure.identity must be a list"),
    ({"model_type": "gpt2", "normswap": {"slicing": [1]}}, "slicing must be a mapping"),
    (_block(slicing={"hidden_size": 0}), "slicing.hidden_size must be"),
    (_block(slicing={"hidden_size": 40}), "slicing.hidden_size must be at most"),
    (_block(slicing={"blocks": 3}), "slicing.blocks must be"),
    (_block(slicing={"stream_axes": [["(", 1]]}), "slicing.stream_axes must be"),
    (_block(slicing={"stream_axes": [["x", "1"]]}), "slicing.stream_axes must be"),
    (_block(slicing={"branches": [["ln_1"]]}), "slicing.branches must be"),
])  # fmt: skip
def test_provenance_refuses_each_bad_field(tmp_path, config, needle):
    with pytest.raises(NormswapError) as caught:
        Provenance.of(config, tmp_path)
    message = str(caught.value)
    assert needle in message and "\n" not in message, message


def test_provenance_accepts_what_normswap_writes(tmp_path):
    for config in (_block(GOOD_ROTATION), _block({"method": "pca", "seed": None}), _block(slicing={}),
                   _block({"form": "free"}, writers_centred=0, structure={"identity": ["a.b"]})):
        assert Provenance.of(config, tmp_path) is not None


def test_structure_kinds_are_the_structure_fields():
    from dataclasses import fields

    from normswap.convert.steps import Structure

    assert STRUCTURE_KINDS == tuple(f.name for f in fields(Structure))


def test_structure_naming_an_unknown_module_is_refused_at_load(pair, tmp_path, capsys):
    import normswap

    _, converted = pair
    tampered = tmp_path / "tampered"
    shutil.copytree(converted, tampered)
    config = json.loads((tampered / "config.json").read_text())
    config["normswap"]["structure"] = {"identity": ["nonexistent.x"]}
    (tampered / "config.json").write_text(json.dumps(config))
    with pytest.raises(NormswapError, match="structure.identity names the module 'nonexistent.x'"):
        normswap.load(tampered)
    assert main(["geometry", str(tampered)]) == 2
    assert "nonexistent.x" in capsys.readouterr().err


def test_rotation_of_a_folded_conversion_is_verified_against_it(pair, tmp_path, capsys):
    """A rotation of a --fold-gains conversion names that conversion as its source and is verified
    against it; against the original it is refused in one line (the folded weights were rounded first)."""
    src, _ = pair
    folded, rotated = tmp_path / "folded", tmp_path / "rotated"
    assert main(["convert", str(src), "--out", str(folded), "--fold-gains", "--quiet", "--verify", "none"]) == 0
    assert main(["rotate", str(folded), "--out", str(rotated), "--quiet", "--verify", "none"]) == 0
    block = json.loads((rotated / "config.json").read_text())["normswap"]
    assert block["source"] == block["rotated_from"] == str(folded) and block["rotated_from_source"] == str(src)
    card = (rotated / "README.md").read_text()
    assert f"the same function as `{folded}`" in card and "that claim was not checked here" in card
    assert f"same function as `{src}`" not in card
    capsys.readouterr()
    assert main(["verify", str(folded), str(rotated)]) == 0, capsys.readouterr().err
    assert main(["verify", str(src), str(rotated)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "verify it against that conversion" in err, err
