"""The algebraic pre-check: centred writers, untouched tensors and folded readers, read off the
weights alone, and the first wrong tensor named before any model runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_hard, save
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

import normswap
from normswap.cli import main
from normswap.errors import VerificationError
from normswap.verify.precheck import precheck


def _tiny(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32)
    return save(make_hard(GPT2LMHeadModel(config)).to(dtype), path)


def _edit(out: Path, name: str, change) -> None:
    state = load_file(out / "model.safetensors")
    state[name] = change(state[name])
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("fold_gains", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_faithful_conversion_passes(tmp_path, fold_gains, dtype):
    src = _tiny(tmp_path / "src", dtype)
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, fold_gains=fold_gains, verification="none")
    counts = precheck(src, out)
    assert counts["centred"] == 2 * 4 + 2  # per block: two writers (weight, bias); wte and wpe
    assert counts["untouched"] > 0 or fold_gains  # folding touches every reader and norm
    assert (counts["folded"] > 0) == fold_gains


def test_a_writer_that_is_not_centred_is_named(tmp_path, capsys):
    src = _tiny(tmp_path / "src")
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    _edit(out, "transformer.h.1.attn.c_proj.weight", lambda w: w + 0.01)  # a mean along the hidden axis
    with pytest.raises(VerificationError, match=r"transformer\.h\.1\.attn\.c_proj\.weight is a centred writer"):
        precheck(src, out)
    assert main(["verify", str(src), str(out)]) != 0
    assert "pre-check: transformer.h.1.attn.c_proj.weight" in capsys.readouterr().err


def test_a_changed_untouched_tensor_is_named(tmp_path):
    src = _tiny(tmp_path / "src")
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")

    def flip_one(w):
        w = w.clone()
        w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(1e9))  # one unit in the last place
        return w

    _edit(out, "transformer.h.0.mlp.c_fc.weight", flip_one)
    with pytest.raises(VerificationError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight should be .* unchanged"):
        precheck(src, out)


def test_a_wrong_folded_reader_is_named(tmp_path):
    src = _tiny(tmp_path / "src")
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, fold_gains=True, verification="none")
    _edit(out, "transformer.h.0.attn.c_attn.weight", lambda w: w * 1.001)
    with pytest.raises(VerificationError, match=r"c_attn\.weight should be .* times the gain"):
        precheck(src, out)


@pytest.mark.slow
def test_verification_records_the_precheck(tmp_path):
    src = _tiny(tmp_path / "src")
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    result = normswap.verify_checkpoint(src, out)
    assert result["passed"] and result["precheck"]["centred"] == 10
    assert "precheck" not in normswap.verify_checkpoint(src, out, precheck=False)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    src = _tiny(tmp_path / "src")
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    _edit(out, "transformer.h.0.mlp.c_fc.bias", lambda b: b[:-1].clone())
    with pytest.raises(VerificationError, match=r"transformer\.h\.0\.mlp\.c_fc\.bias has shape \[127\]"):
        precheck(src, out)
