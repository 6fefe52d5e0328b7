"""The model-class facts adapters declare (normswap.architectures.facts) equal what transformers'
classes, built on the meta device, give: state-dict names and shapes, LayerNorm modules, the base
prefix, load-time renaming and the module paths structure patterns resolve to, for every family
and every config variant the adapters know. Planning from them (``inspect``) gives the same plan
as planning from the class."""

from __future__ import annotations

import re
import warnings

import pytest
import test_architectures_encoders as ENCODERS
import transformers
from test_architectures_causal import CASES as CAUSAL_CASES

from normswap.architectures import ARCHITECTURES
from normswap.architectures.facts import ModelFacts, facts_of_model
from normswap.convert.names import resolve_structure
from normswap.errors import NormswapError
from normswap.modeling import build

GPT2_SMALL = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 16, "vocab_size": 61}
# id -> (config dict as config.json holds it, declared class or None for the family's default)
CASES: dict[str, dict] = {
    "gpt2-lm": transformers.GPT2Config(**GPT2_SMALL).to_diff_dict(),
    "gpt2-cross-attention": transformers.GPT2Config(**GPT2_SMALL, add_cross_attention=True).to_diff_dict(),
    "gpt2-inner": transformers.GPT2Config(**GPT2_SMALL, n_inner=48).to_diff_dict(),
    "gpt2-class-defaults": {"model_type": "gpt2", "n_layer": 1},  # every other size from GPT2Config
    **{case: {**make().to_diff_dict(), "model_type": make().model_type} for case, make in CAUSAL_CASES.items()},
    "opt-defaults": {"model_type": "opt", "num_hidden_layers": 1},
    "falcon-old-two-norms": {**CAUSAL_CASES["falcon-parallel-mqa"]().to_diff_dict(), "model_type": "falcon",
                             "num_ln_in_parallel_attn": 2},
    "falcon-new-default-norms": {"model_type": "falcon", "num_hidden_layers": 1, "new_decoder_architecture": True,
                                 "num_kv_heads": 8},
    "gpt_neox-defaults": {"model_type": "gpt_neox", "num_hidden_layers": 1},
    "gpt_bigcode-defaults": {"model_type": "gpt_bigcode", "n_layer": 1},
    "whisper": {**transformers.WhisperConfig(**ENCODERS.WHISPER).to_diff_dict(), "model_type": "whisper",
                "architectures": ["WhisperForConditionalGeneration"]},
    "vit-model": {**transformers.ViTConfig(**ENCODERS.VIT).to_diff_dict(), "model_type": "vit",
                  "architectures": ["ViTModel"]},
    "vit-classifier": {**transformers.ViTConfig(**ENCODERS.VIT, num_labels=3).to_diff_dict(), "model_type": "vit",
                       "architectures": ["ViTForImageClassification"]},
    "vit-classifier-no-qkv-bias": {**transformers.ViTConfig(**ENCODERS.VIT, qkv_bias=False).to_diff_dict(),
                                   "model_type": "vit", "architectures": ["ViTForImageClassification"]},
    **{f"clip-{name}": {**config().to_diff_dict(), "model_type": config().model_type, "architectures": [cls.__name__]}
       for name, (cls, config, _) in ENCODERS.CLIP_CASES.items()},
    "clip-text-projection": {**transformers.CLIPTextConfig(**ENCODERS.CLIP_TEXT).to_diff_dict(),
                             "model_type": "clip_text_model", "architectures": ["CLIPTextModelWithProjection"]},
    "clip-vision-projection": {**transformers.CLIPVisionConfig(**ENCODERS.CLIP_VISION).to_diff_dict(),
                               "model_type": "clip_vision_model", "architectures": ["CLIPVisionModelWithProjection"]},
    "phi-gqa": {**CAUSAL_CASES["phi-tied-headbias"]().to_diff_dict(), "model_type": "phi", "num_key_value_heads": 2},
}


def _class_facts(config: dict) -> tuple[ModelFacts, object]:
    architecture = ARCHITECTURES[config["model_type"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = build.meta_model(config, architecture.auto_class)
    return facts_of_model(meta), meta


def _probe_keys(facts: ModelFacts) -> list[str]:
    """Checkpoint keys to rename: the class's own, without the base prefix, and legacy spellings."""
    keys = []
    for name in facts.tensors:
        stem = name.removeprefix(facts.base_prefix + ".")
        keys += [name, stem, stem.replace(".weight", ".gamma"), re.sub(r"\.\w+$", ".LayerNorm.beta", stem),
                 stem.replace(".weight", ".weight_g"), "embed_out." + stem.rsplit(".", 1)[-1]]
    legacy_vit = [f"{prefix}encoder.layer.1.{name}" for prefix in ("", "vit.") for name in (
        "attention.attention.query.weight", "attention.attention.key.bias", "attention.attention.value.weight",
        "attention.output.dense.bias", "intermediate.dense.weight", "output.dense.weight", "layernorm_before.weight")]
    legacy_clip = [f"{scope}{tower}_model.{name}" for scope in ("", "text_model.", "vision_model.")
                   for tower in ("text", "vision") for name in (
        "encoder.layers.0.layer_norm1.weight", "embeddings.class_embedding", "final_layer_norm.bias")]
    return keys + legacy_vit + legacy_clip + ["model.language_model.model.x.weight", "language_model.model.model.y.bias",
                                "embed_out.weight"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_declared_facts_equal_the_class(case):
    config = CASES[case]
    architecture = ARCHITECTURES[config["model_type"]]
    declared = architecture.facts(config)
    assert declared is not None, f"{case}: the adapter declares no facts for this config"
    reference, meta = _class_facts(config)
    assert declared.base_prefix == reference.base_prefix
    assert list(declared.tensors.items()) == list(reference.tensors.items())
    assert declared.layer_norms == reference.layer_norms
    module_names = [name for name, _ in meta.named_modules()]
    assert set(declared.module_names) <= set(module_names)
    assert declared.module_names == [name for name in module_names if name in set(declared.module_names)]
    renamer = build.checkpoint_renamer(meta)
    assert {key: declared.rename(key) for key in _probe_keys(reference)} == \
           {key: renamer(key) for key in _probe_keys(reference)}
    adapter = architecture.for_config(config)
    structure = adapter.structure(config)
    assert resolve_structure(structure, declared.module_names) == resolve_structure(structure, module_names)


def test_names_of_blocks_a_sampled_model_lacks_are_kept_without_renaming():
    """The forward passes build the first blocks only; the checkpoint's names of the other blocks
    are the class's own form, so transformers' renaming table (tenths of a second to build) is
    not asked about them, while a name of another form still is."""
    from normswap.checkpoint.names import canonical_names

    keys = {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight", "lm_head.weight"}
    asked = []

    def rename(name: str) -> str:
        asked.append(name)
        return name

    names = ["transformer.h.47.attn.c_attn.weight", "lm_head.weight", "h.0.attn.c_attn.weight"]
    mapping = canonical_names(names, keys, "transformer", rename)
    assert mapping == {"transformer.h.47.attn.c_attn.weight": "transformer.h.47.attn.c_attn.weight",
                       "lm_head.weight": "lm_head.weight", "h.0.attn.c_attn.weight": "transformer.h.0.attn.c_attn.weight"}
    assert asked == ["h.0.attn.c_attn.weight"]


def test_every_declared_class_is_tested():
    tested = set()
    for config in CASES.values():
        architecture = ARCHITECTURES[config["model_type"]]
        tested.add((architecture.model_types[0], (config.get("architectures") or [architecture.default_class])[0]))
    declared = {(architecture.model_types[0], name) for architecture in ARCHITECTURES.values()
                for name in architecture.classes}
    assert declared <= tested, f"declared but not compared with transformers: {sorted(declared - tested)}"


@pytest.mark.parametrize("config, why", [
    ({"model_type": "gpt2", "hidden_size": 32, "n_head": 4}, "a config-class alias"),
    ({"model_type": "gpt2", "n_embd": 30, "n_head": 4}, "a size the class refuses"),
    ({"model_type": "gpt2", "n_layer": "2"}, "not a positive integer"),
    ({"model_type": "gpt2", "architectures": ["GPT2Model"]}, "an undeclared class"),
    ({"model_type": "gpt2", "architectures": ["BloomForCausalLM"]}, "another family's class"),
    ({"model_type": "phi", "qk_layernorm": True}, "a variant the adapter refuses"),
])
def test_configs_the_declarations_do_not_cover_build_the_class(config, why):
    assert ARCHITECTURES[config["model_type"]].facts(config) is None, why


def test_common_activations_are_transformers_own():
    from transformers.activations import ACT2CLS

    from normswap.checkpoint.validation import COMMON_ACTIVATIONS

    assert COMMON_ACTIVATIONS <= set(ACT2CLS)


@pytest.mark.parametrize("model_type", sorted(name for name, a in ARCHITECTURES.items() if a.tie_default is not None))
def test_declared_tie_default_is_the_config_class_default(model_type):
    architecture = ARCHITECTURES[model_type]
    config_class = transformers.CONFIG_MAPPING[model_type]
    assert getattr(config_class(), architecture.tie_flag) is architecture.tie_default


def _save(case: str, folder) -> object:
    """A tiny random checkpoint of ``case``, as save_pretrained writes it."""
    import torch
    from helpers import make_hard, save

    config = transformers.AutoConfig.for_model(**CASES[case])
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(transformers, (CASES[case].get("architectures") or [None])[0] or "", None)
        model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
        return save(make_hard(model).eval(), folder / case)


def _inspect(src, capsys, *options: str) -> str:
    from normswap.cli import main

    assert main(["inspect", str(src), *options]) == 0
    return capsys.readouterr().out


INSPECTED = sorted(case for case in CASES if not case.endswith("-defaults") and case != "falcon-new-default-norms")


@pytest.mark.parametrize("case", INSPECTED)
def test_inspect_prints_the_plan_of_the_class(tmp_path, case, capsys, monkeypatch):
    """Text and JSON, with and without --fold-gains: planning from the declared facts prints
    exactly what planning from the model class prints."""
    from normswap.architectures.spec import Architecture
    from normswap.checkpoint.source import read_config

    src = _save(case, tmp_path)
    config = read_config(src)
    assert ARCHITECTURES[config["model_type"]].facts(config) is not None  # the declared path is taken
    options = [(), ("--fold-gains",), ("--json",), ("--json", "--fold-gains")]
    declared = [_inspect(src, capsys, *option) for option in options]
    monkeypatch.setattr(Architecture, "facts", lambda self, config: None)  # build the class instead
    assert declared == [_inspect(src, capsys, *option) for option in options]


@pytest.mark.parametrize("options", [(), ("--json", "--fold-gains")])
def test_inspect_of_the_bundled_model_imports_neither_torch_nor_transformers(options):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "normswap", "inspect", "normswap:austen-gpt2",
                             *options], capture_output=True, text=True, cwd=root, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers"}
    assert "transformer.ln_f" in result.stdout


def test_inspect_from_declared_facts_refuses_a_shape_the_config_does_not_imply(tmp_path, capsys):
    import json

    from normswap.cli import main

    src = _save("gpt2-inner", tmp_path)  # n_inner 48
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "n_inner": 64}))
    assert ARCHITECTURES["gpt2"].facts({**config, "n_inner": 64}) is not None
    assert main(["inspect", str(src)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "has shape [48], but" in line and "implies [64]" in line


@pytest.mark.parametrize("command", [["convert"], ["convert", "--fold-gains"], ["rotate"], ["rotate", "--form", "free"]])
def test_convert_and_rotate_plan_without_building_the_class(tmp_path, command, monkeypatch):
    from normswap.cli import main

    def refused(*args, **kwargs):
        raise AssertionError("the model class was built to plan")

    monkeypatch.setattr(build, "meta_model", refused)
    out = tmp_path / "out"
    assert main([command[0], "normswap:austen-gpt2", "--out", str(out), *command[1:], "--verify", "none",
                 "--quiet"]) == 0
    assert (out / "config.json").is_file()


def _outcome(function, *args):
    try:
        return function(*args)
    except NormswapError as error:
        return str(error)


def test_class_names_from_the_tables_are_the_classes_names():
    """``class_names`` reads the Auto tables instead of importing a family's modeling code; for
    every family, its default class and each class it declares facts for, the names are those
    the classes themselves give, and a class of another family is still refused."""
    for model_type, architecture in ARCHITECTURES.items():
        configs = [{"model_type": model_type}]
        configs += [{"model_type": model_type, "architectures": [name]} for name in architecture.classes
                    if isinstance(name, str) and hasattr(transformers, name)]
        for config in configs:
            assert _outcome(build.class_names, config, architecture.auto_class) == _outcome(
                build.names_from_classes, config, architecture.auto_class), config
    with pytest.raises(NormswapError, match="names BloomForCausalLM, a bloom class"):
        build.class_names({"model_type": "gpt2", "architectures": ["BloomForCausalLM"]}, "AutoModelForCausalLM")
