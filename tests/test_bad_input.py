"""Every bad input gets one line on stderr, a non-zero exit, no traceback, and nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import leftovers, make_hard, save
from transformers import GPT2Config, GPT2LMHeadModel

from normswap.cli import main


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
    return save(make_hard(GPT2LMHeadModel(config)), tmp_path_factory.mktemp("src") / "gpt2")


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unsupported_architecture_lists_supported(tmp_path, capsys):
    src = tmp_path / "weird"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (src / "model.safetensors").write_bytes(b"")
    code, err = run_cli(capsys, "convert", str(src), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "unsupported architecture 'llama'", "gpt2")
    assert not (tmp_path / "out").exists()


def test_post_ln_explains_why(tmp_path, capsys):
    src = tmp_path / "bert"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (src / "model.safetensors").write_bytes(b"")
    code, err = run_cli(capsys, "convert", str(src), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "post-LN")


def test_already_converted(gpt2_dir, tmp_path, capsys):
    out = tmp_path / "rms"
    assert main(["convert", str(gpt2_dir), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    code, err = run_cli(capsys, "convert", str(out), "--out", str(tmp_path / "again"))
    assert_one_line_error(code, err, "already converted")
    assert not (tmp_path / "again").exists()


@pytest.mark.slow
def test_out_not_empty_needs_overwrite(gpt2_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, err = run_cli(capsys, "convert", str(gpt2_dir), "--out", str(out))
    assert_one_line_error(code, err, "--overwrite")
    assert (out / "keep.txt").read_text() == "precious"
    # --overwrite replaces only a folder normswap wrote: this one it refuses, and keeps
    code, err = run_cli(capsys, "convert", str(gpt2_dir), "--out", str(out), "--overwrite", "--quiet")
    assert_one_line_error(code, err, "not written by normswap")
    assert (out / "keep.txt").read_text() == "precious"
    mine = tmp_path / "mine"
    assert main(["convert", str(gpt2_dir), "--out", str(mine), "--quiet"]) == 0
    assert main(["convert", str(gpt2_dir), "--out", str(mine), "--overwrite", "--quiet"]) == 0
    # a file the user added to a normswap output is theirs: --overwrite refuses and keeps it
    (mine / "extra.txt").write_text("added later")
    code, err = run_cli(capsys, "convert", str(gpt2_dir), "--out", str(mine), "--overwrite", "--quiet")
    assert_one_line_error(code, err, "extra.txt")
    assert (mine / "extra.txt").read_text() == "added later" and (mine / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


def test_never_overwrites_the_source(gpt2_dir, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(gpt2_dir, src)
    before = {path.name: path.read_bytes() for path in src.iterdir()}
    for out in (src, src / "inside"):
        code, err = run_cli(capsys, "convert", str(src), "--out", str(out), "--overwrite")
        assert_one_line_error(code, err, "input")
    assert {path.name: path.read_bytes() for path in src.iterdir()} == before


def test_missing_weights(gpt2_dir, tmp_path, capsys):
    src = tmp_path / "noweights"
    src.mkdir()
    shutil.copyfile(gpt2_dir / "config.json", src / "config.json")
    code, err = run_cli(capsys, "convert", str(src), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "no weights")


def test_corrupt_weights(gpt2_dir, tmp_path, capsys):
    src = tmp_path / "corrupt"
    shutil.copytree(gpt2_dir, src)
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    code, err = run_cli(capsys, "convert", str(src), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "corrupt")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_missing_source_and_config(tmp_path, capsys):
    code, err = run_cli(capsys, "convert", str(tmp_path / "nope" / "x y"), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "does not exist")
    (tmp_path / "empty").mkdir()
    code, err = run_cli(capsys, "convert", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "config.json")


def test_hub_id_offline_says_pass_a_local_path(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = run_cli(capsys, "convert", "openai-community/gpt2-medium", "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "could not fetch", "local")


def test_naive_without_allow_inexact(gpt2_dir, tmp_path, capsys):
    code, err = run_cli(capsys, "convert", str(gpt2_dir), "--out", str(tmp_path / "o"), "--method", "naive")
    assert_one_line_error(code, err, "--allow-inexact")


def test_bad_dtype(gpt2_dir, tmp_path, capsys):
    code, err = run_cli(capsys, "convert", str(gpt2_dir), "--out", str(tmp_path / "o"), "--dtype", "int3")
    assert_one_line_error(code, err, "unknown dtype")


def test_failed_verification_leaves_nothing(gpt2_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_cli(capsys, "convert", str(gpt2_dir), "--out", str(out), "--atol", "0", "--rtol", "0", "--quiet")
    assert_one_line_error(code, err, "verification failed")
    assert code == 3
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_source_remote_code_never_runs(tmp_path, capsys):
    src = tmp_path / "custom"
    src.mkdir()
    marker = tmp_path / "ran"
    (src / "config.json").write_text(json.dumps({
        "model_type": "my_custom", "auto_map": {"AutoConfig": "modeling_custom.MyConfig"},
    }))
    (src / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (src / "model.safetensors").write_bytes(b"")
    for extra in ([], ["--trust-remote-code"]):
        code, err = run_cli(capsys, "convert", str(src), "--out", str(tmp_path / "out"), *extra)
        assert_one_line_error(code, err, "unsupported architecture")
    assert not marker.exists()


def test_bin_is_loaded_without_unpickling_code(gpt2_dir, tmp_path, capsys):
    """A pickle that would run code when unpickled is refused (weights_only=True)."""
    src = tmp_path / "evil"
    src.mkdir()
    shutil.copyfile(gpt2_dir / "config.json", src / "config.json")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"transformer.wte.weight": Evil()}, src / "pytorch_model.bin")
    code, err = run_cli(capsys, "convert", str(src), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "other than tensors")
    assert "weights_only=False" not in err
    assert not marker.exists()


def test_verify_rejects_non_normswap_checkpoint(gpt2_dir, capsys):
    code, err = run_cli(capsys, "verify", str(gpt2_dir), str(gpt2_dir))
    assert_one_line_error(code, err, "not a normswap checkpoint")


def test_load_rejects_non_normswap_checkpoint(gpt2_dir):
    import normswap
    from normswap.errors import NormswapError

    with pytest.raises(NormswapError, match="not a normswap checkpoint"):
        normswap.load(gpt2_dir)
