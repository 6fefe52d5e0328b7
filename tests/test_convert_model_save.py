"""``normswap.convert_model`` then ``save_pretrained`` writes what ``normswap convert`` writes for the
same weights, so the two load identically (stock classes, remote code, ``normswap.load``)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import causal_logits, load, make_hard, token_ids
from test_architectures_causal import CASES, VOCAB
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import normswap
from normswap.errors import NormswapError

GPT2 = lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32)  # noqa: E731


@pytest.mark.parametrize(("make", "stock_loadable"), [(GPT2, True), (CASES["bloom-baked"], False)],
                         ids=["gpt2", "bloom-baked"])
def test_saved_in_memory_conversion_is_the_command_output(tmp_path, make, stock_loadable):
    torch.manual_seed(0)
    model = make_hard(transformers.AutoModelForCausalLM.from_config(make())).eval()
    model.save_pretrained(tmp_path / "src")
    normswap.convert_checkpoint(tmp_path / "src", tmp_path / "command", fold_gains=True, verification="none")
    normswap.convert_model(model, fold_gains=True).save_pretrained(tmp_path / "memory")

    command, memory = tmp_path / "command", tmp_path / "memory"
    assert sorted(p.name for p in memory.iterdir()) == sorted(p.name for p in command.iterdir())
    for name in ("model.safetensors", "modeling_normswap.py", "generation_config.json", ".normswap-output"):
        assert (memory / name).read_bytes() == (command / name).read_bytes(), name
    from_command, from_memory = (json.loads((path / "config.json").read_text()) for path in (command, memory))
    assert from_memory["normswap"].pop("source") == "an in-memory model"
    assert from_command["normswap"].pop("source") == str(tmp_path / "src")
    assert from_memory == from_command  # auto_map, model type, provenance: all of it
    assert "auto_map" in from_memory and from_memory["normswap"]["stock_loadable"] is stock_loadable
    card, named = (memory / "README.md").read_text(), (command / "README.md").read_text()
    assert f'base_model: "{tmp_path / "src"}"\n' in named and "base_model" not in card  # memory names no source
    assert card.replace("an in-memory model", str(tmp_path / "src")) == named.replace(f'base_model: "{tmp_path / "src"}"\n', "")
    assert (from_memory["model_type"] in CONFIG_MAPPING_NAMES) is stock_loadable  # stock refuses bloom's

    ids = token_ids(VOCAB)
    hows = ["remote", "normswap"] + (["stock"] if stock_loadable else [])
    for how in hows:
        a, b = (causal_logits(load(path, how, torch.float32), ids) for path in (command, memory))
        assert torch.equal(a, b), how


def test_save_refuses_other_models_and_foreign_folders(tmp_path):
    model = transformers.GPT2LMHeadModel(GPT2()).eval()
    with pytest.raises(NormswapError, match="convert_model"):
        normswap.save(model, tmp_path / "out")
    converted = normswap.convert_model(model)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(NormswapError, match="not written by normswap"):
        converted.save_pretrained(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    converted.save_pretrained(tmp_path / "out")
    converted.save_pretrained(tmp_path / "out")  # its own earlier output is replaced, whole
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # a file added to it since is the user's: saving again refuses and keeps it
    (tmp_path / "out" / "tokenizer.json").write_text("{}")
    with pytest.raises(NormswapError, match="tokenizer.json"):
        converted.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"


def test_a_model_built_in_memory_saves_below_the_current_folder(tmp_path, monkeypatch):
    """A model made from a config has no input folder: ``./out`` is not "inside the input"; an
    error names the API's argument, not the CLI's flag."""
    monkeypatch.chdir(tmp_path)
    normswap.save(normswap.convert_model(transformers.GPT2LMHeadModel(GPT2()).eval()), "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    with pytest.raises(NormswapError, match=r"^folder .*is or contains the current folder"):
        normswap.save(normswap.convert_model(transformers.GPT2LMHeadModel(GPT2()).eval()), ".")
