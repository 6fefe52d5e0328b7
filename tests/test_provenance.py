"""The typed provenance view, and each config.json read once per command.

Following a checkpoint through ``verify`` (whole and layer by layer) and through ``rotate`` (write,
then verify what was written), normswap parses each config.json once and passes it down.
"""

from __future__ import annotations

import collections
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import save

from normswap.checkpoint import source
from normswap.checkpoint.provenance import Provenance, family_config, original_model_type
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
