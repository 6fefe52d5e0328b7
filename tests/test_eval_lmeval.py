"""lm-eval integration and ``normswap eval``: local tasks on the bundled model, clear errors. Offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from normswap.checkpoint.source import EXAMPLE_MODEL, example_model_path
from normswap.cli import main
from normswap.evaluation import hub, lmeval
from normswap.evaluation.text import BUNDLED_TEXT, TextSource

LOCAL = ["persuasion_cloze", "persuasion_lastword", "persuasion_rolling"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Behave as offline whatever the network: these tests must not depend on it."""
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)


@pytest.fixture(scope="module")
def model_src(tmp_path_factory) -> str:
    """The bundled example model, which ships in the package (no file outside the repository is needed)."""
    assert (example_model_path() / "config.json").is_file()
    return EXAMPLE_MODEL


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    """A few paragraphs of held-out text (the bundled excerpt when present) for quick perplexity."""
    source = BUNDLED_TEXT.read_text(encoding="utf-8") if BUNDLED_TEXT.is_file() else (
        "Anne Elliot walked to Uppercross.\n\nThe weather was fine, and the walk was pleasant.\n\n" * 20)
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text(source[:3000], encoding="utf-8")
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_local_tasks_materialise_with_absolute_paths(tmp_path):
    plan = lmeval.plan_tasks(["local"], with_text_task=True)
    assert plan.local == [*LOCAL, lmeval.TEXT_TASK] and plan.hub == []
    text = TextSource(name="t", documents=["one doc", "two doc"], joined="one doc\n\ntwo doc")
    folder = lmeval.materialise_tasks(tmp_path / "tasks", plan.local, text)
    for yaml_file in folder.glob("*.yaml"):
        config = yaml.safe_load(yaml_file.read_text())
        data = Path(config["dataset_kwargs"]["data_files"]["test"])
        assert data.is_absolute() and data.is_file(), yaml_file
    assert len((folder / f"{lmeval.TEXT_TASK}.jsonl").read_text().splitlines()) == 2
    # shipped data: every row parses and the cloze labels point at a choice
    for row in map(json.loads, (lmeval.evals_dir() / "data" / "persuasion_cloze.jsonl").read_text().splitlines()):
        assert 0 <= row["label"] < len(row["choices"]) == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "no_such_task"], "unknown task(s) 'no_such_task'"),
        (["--tasks", "hellaswag"], "needs the Hugging Face hub"),
        (["--text", "/no/such/file.txt"], "is not a file, a directory"),
        (["--text", "wikitext-2-raw-v1"], "needs the Hugging Face hub"),
        (["--dtype", "fp12"], "unknown dtype"),
        (["--plot"], "--plot needs --out"),
        (["--stride", "4096"], "--stride must be between"),
    ],
)
def test_eval_user_errors_are_one_line(capsys, model_src, small_text, argv, message):
    # a later --text overrides this one
    code, _out, err = run_cli(capsys, "eval", model_src, "--text", str(small_text), *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_local_tasks_run_on_the_model(capsys, tmp_path, model_src, small_text):
    out = tmp_path / "report"
    code, stdout, _err = run_cli(
        capsys, "eval", model_src, "--text", str(small_text), "--tasks", "local", "--limit", "3",
        "--batch-size", "4", "--out", str(out), "--plot", "--no-progress",
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    metrics = report["models"]["model"]["metrics"]
    for key in ("persuasion_rolling/word_perplexity", "persuasion_rolling/bits_per_byte",
                "persuasion_lastword/acc", "persuasion_lastword/perplexity",
                "persuasion_cloze/acc", "persuasion_cloze/acc_norm",
                "normswap_text/byte_perplexity", "strided/token_perplexity"):
        assert key in metrics, key
    assert all(0.0 <= metrics[f"persuasion_{k}"] <= 1.0 for k in ("cloze/acc", "lastword/acc"))
    assert 1.0 < metrics["strided/token_perplexity"] < 1e6
    assert report["models"]["model"]["details"]["lm_eval_docs"]["persuasion_cloze"] == 3
    assert "| strided/token_perplexity |" in stdout
    assert (out / "report.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("path", ["shared", "plain", "pair"])
def test_no_progress_leaves_stderr_empty(tmp_path, path):
    """--no-progress silences every bar (lm-eval's request bars pass ``disable=`` explicitly) and
    the tokenizer's warning about documents longer than the context, which lm-eval encodes whole."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "normswap", "eval", "normswap:austen-gpt2", "--no-perplexity",
            "--tasks", "persuasion_lastword,persuasion_rolling", "--limit", "3", "--no-progress"]
    if path == "plain":
        argv.append("--plain-lm-eval")
    if path == "pair":  # side by side on two or three idle cores: the copy draws no bar either
        argv += ["--baseline", "normswap:austen-gpt2"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ""
    assert "persuasion_lastword/acc" in done.stdout
