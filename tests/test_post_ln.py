"""Post-LN models are refused with the reason, through the API and the CLI (one line, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

import normswap
from normswap.architectures import ARCHITECTURES, POST_LN
from normswap.cli import main
from normswap.errors import NormswapError

# The refusal is a lookup of the config's model_type, made before any weight is read: a checkpoint
# needs the family's own config.json (as transformers writes it) and a weight file, not a model.
MODEL_TYPES = sorted(POST_LN)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("post-ln")
    made = {}
    for model_type in MODEL_TYPES:
        path = root / model_type
        path.mkdir()
        AutoConfig.for_model(model_type).save_pretrained(path)
        save_file({"embeddings.weight": torch.zeros(4, 2)}, path / "model.safetensors")
        made[model_type] = path
    return made


def test_post_ln_families_are_listed():
    """The common post-LN families are named, none of them also has an adapter."""
    assert {"bert", "roberta", "distilbert", "bart"} <= set(POST_LN)
    assert not set(POST_LN) & set(ARCHITECTURES)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_api_refuses_post_ln(checkpoints, tmp_path, model_type):
    out = tmp_path / "out"
    with pytest.raises(NormswapError, match=model_type) as error:
        normswap.convert_checkpoint(checkpoints[model_type], out)
    assert str(error.value) == f"cannot convert model type '{model_type}': {POST_LN[model_type]}"
    assert "\n" not in str(error.value)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left beside --out


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cli_refuses_post_ln(checkpoints, tmp_path, capsys, model_type):
    code = main(["convert", str(checkpoints[model_type]), "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code != 0
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and POST_LN[model_type] in lines[0] and model_type in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_process_refuses_post_ln(checkpoints, tmp_path):
    """The real entry point: ``python -m normswap convert`` exits non-zero with one stderr line."""
    result = subprocess.run(
        [sys.executable, "-m", "normswap", "convert", str(checkpoints["bert"]), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "post-LN" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
