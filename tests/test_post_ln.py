"""Post-LN models are refused with the reason, through the API and the CLI (one line, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers as T
from helpers import save

import normswap
from normswap.cli import main
from normswap.errors import NormswapError

SMALL = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, vocab_size=40,
             max_position_embeddings=16)
MODELS = {
    "bert": lambda: T.BertModel(T.BertConfig(**SMALL)),
    "roberta": lambda: T.RobertaModel(T.RobertaConfig(**SMALL, pad_token_id=1)),
    "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(dim=16, n_layers=1, n_heads=2, hidden_dim=24,
                                                               vocab_size=40, max_position_embeddings=16)),
    "bart": lambda: T.BartModel(T.BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                             decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
                                             vocab_size=40, max_position_embeddings=16)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("post-ln")
    return {name: save(build(), root / name) for name, build in MODELS.items()}


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_api_refuses_post_ln(checkpoints, tmp_path, model_type):
    out = tmp_path / "out"
    with pytest.raises(NormswapError, match="post-LN") as error:
        normswap.convert_checkpoint(checkpoints[model_type], out)
    assert model_type in str(error.value) and "no exact RMSNorm conversion" in str(error.value)
    assert "\n" not in str(error.value)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left beside --out


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_cli_refuses_post_ln(checkpoints, tmp_path, capsys, model_type):
    code = main(["convert", str(checkpoints[model_type]), "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code != 0
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "post-LN" in lines[0] and model_type in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out").exists()


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
