"""``normswap run``: the offline recipe end to end, and clear errors for bad recipes. Offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from normswap.checkpoint.source import example_model_path
from normswap.cli import main
from normswap.evaluation import hub
from normswap.evaluation.recipe import RECIPES_DIR, load_recipe
from normswap.evaluation.text import BUNDLED_TEXT


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    """A tiny random GPT-2 with the bundled model's tokenizer (2048 tokens), which ships in the package."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=128, vocab_size=2048,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(example_model_path()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def offline_recipe(tmp_path_factory) -> Path:
    """normswap/recipes/austen-gpt2.yaml, on the bundled model and text that ship in the package."""
    assert (example_model_path() / "config.json").is_file() and BUNDLED_TEXT.is_file()
    return RECIPES_DIR / "austen-gpt2.yaml"


def test_shipped_recipes_are_valid():
    names = {path.stem for path in RECIPES_DIR.glob("*.yaml")}
    assert {"gpt2", "austen-gpt2"} <= names and len(names) >= 4
    for name in names:
        load_recipe(RECIPES_DIR / f"{name}.yaml")
    anchors = load_recipe(RECIPES_DIR / "gpt2.yaml").reference
    assert anchors["strided/token_perplexity"] == 29.94 and anchors["wikitext/word_perplexity"] == 37.37
    assert anchors["lambada_openai/acc"] == 0.3256 and anchors["winogrande/acc"] == 0.5162


@pytest.mark.slow
def test_offline_recipe_end_to_end(capsys, tmp_path, offline_recipe):
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, "run", str(offline_recipe), "--out", str(out), "--limit", "3",
                                "--no-progress", "--plot")
    assert code == 0, err
    assert "Comparison: PASS" in stdout
    for name in ("report.json", "report.md", "report.png", "conversion.json", "recipe.yaml", "converted/config.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "pass"
    rows = {row["key"]: row for row in report["comparison"]["metrics"]}
    assert rows["strided/token_perplexity"]["rel_delta"] is not None
    assert abs(rows["strided/token_perplexity"]["rel_delta"]) < 1e-4
    assert {"persuasion_cloze/acc", "persuasion_lastword/acc", "persuasion_rolling/word_perplexity"} <= set(rows)
    assert all(doc["ok"] for doc in report["comparison"]["documents"])
    assert report["conversion"]["verification"]["passed"] is True
    # a second run into the same folder is refused without --overwrite
    code, _out, err = run_cli(capsys, "run", str(offline_recipe), "--out", str(out))
    assert code == 2 and "--overwrite" in err


@pytest.mark.slow
def test_eval_fails_when_models_differ(capsys, tmp_path):
    a = tiny_checkpoint(tmp_path / "a", seed=0)
    b = tiny_checkpoint(tmp_path / "b", seed=1)
    (tmp_path / "t.txt").write_text("It was a fine day at Kellynch.\n\n" * 20, encoding="utf-8")
    code, stdout, err = run_cli(capsys, "eval", str(b), "--baseline", str(a), "--text", str(tmp_path / "t.txt"),
                                "--no-progress")
    assert code == 3
    assert "Comparison: FAIL" in stdout and "FAIL" in err


BAD_RECIPES = [
    ("source: [unclosed", "not valid YAML"),
    ("- just\n- a list\n", "must be a YAML mapping"),
    ("eval:\n  tasks: [local]\n", "'source' (the model to convert) is required"),
    ("source: gpt2\nevaluation: {}\n", "unknown section(s) evaluation"),
    ("source: gpt2\neval:\n  batchsize: 4\n", "unknown key(s) in 'eval': batchsize"),
    ("source: gpt2\neval:\n  batch_size: four\n", "eval.batch_size must be int"),
    ("source: gpt2\ntolerances:\n  ppl_rtol: tight\n", "tolerances.ppl_rtol must be float"),
    ("source: gpt2\nreference:\n  figures:\n    perplexity: 3\n", "must be named task/metric"),
    ("source: gpt2\ntolerances:\n  ppl_rtol: .nan\n", "tolerances.ppl_rtol must be a finite number >= 0"),
    ("source: gpt2\ntolerances:\n  acc_atol: -1\n", "tolerances.acc_atol must be a finite number >= 0"),
    ("source: gpt2\nverify:\n  atol: .inf\n", "verify.atol must be a finite number >= 0"),
    ("source: gpt2\nverify:\n  verification: none\n", "a recipe always verifies"),
    ("source: gpt2\nverify:\n  verification: fast\n", "verify.verification must be auto, layerwise or full"),
    ("source: gpt2\neval:\n  batch_size: 0\n", "eval.batch_size must be at least 1"),
    ("source: gpt2\neval:\n  stride: 0\n", "eval.stride must be at least 1"),
    ("source: gpt2\neval:\n  limit: .nan\n", "eval.limit must be a positive number"),
    ("source: gpt2\neval:\n  dtype: float8\n", "eval.dtype: unknown dtype 'float8'"),
    ("source: gpt2\nconvert:\n  dtype: int4\n", "convert.dtype: unknown dtype 'int4'"),
    ("source: gpt2\nconvert:\n  method: foo\n", "convert.method must be exact or naive"),
    ("source: gpt2\neval:\n  text: /nonexistent/text.txt\n", "eval.text /nonexistent/text.txt does not exist"),
]


@pytest.mark.parametrize("content, message", BAD_RECIPES)
def test_bad_recipes_are_one_line_errors(capsys, tmp_path, content, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(content, encoding="utf-8")
    code, _out, err = run_cli(capsys, "run", str(recipe), "--out", str(tmp_path / "out"))
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_missing_recipe_and_offline_hub_recipe(capsys, tmp_path):
    code, _out, err = run_cli(capsys, "run", str(tmp_path / "nope.yaml"))
    assert code == 2 and "not found" in err
    code, _out, err = run_cli(capsys, "run", "gpt2", "--out", str(tmp_path / "gpt2"))
    assert code == 2
    assert "needs the Hugging Face hub (model gpt2; task(s) lambada_openai" in err
    assert "dataset wikitext-2-raw-v1" in err and "Traceback" not in err
    assert not (tmp_path / "gpt2").exists()
