"""What users read: no library noise around normswap's own lines, counts in agreement, figures
with enough digits to tell two models apart, converted checkpoints welcome in pipelines."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from normswap.cli import main
from normswap.text import count, format_table

ROOT = Path(__file__).resolve().parents[1]


def test_counts_agree_in_number():
    assert count(1, "norm bias") == "1 norm bias"
    assert count(2, "norm bias") == "2 norm biases"
    assert count(0, "writer") == "0 writers"
    assert count(1, "class") == "1 class" and count(3, "class") == "3 classes"
    assert count(2, "matrix", "matrices") == "2 matrices"


def test_perplexities_print_with_six_digits():
    table = format_table({"remote_code": {"max_abs_diff": 1.234567e-5, "perplexity_reference": 113.4823,
                                          "perplexity_candidate": 113.4961, "passed": True}})
    assert "113.482 | 113.496" in table and "1.23e-05" in table


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("messages") / "austen-rms"
    assert main(["convert", "normswap:austen-gpt2", "--out", str(out), "--verify", "none", "--no-progress"]) == 0
    return out


def test_text_generation_pipeline_accepts_a_converted_checkpoint(converted):
    """``pipeline`` checks the model's class name against its task's table; normswap's classes
    are listed there, so it logs no 'is not supported' error."""
    from transformers import pipeline

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level=logging.DEBUG)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        generate = pipeline("text-generation", model=str(converted), trust_remote_code=True, device="cpu")
        text = generate("Anne", max_new_tokens=3, do_sample=False)[0]["generated_text"]
    finally:
        logger.removeHandler(handler)
    assert type(generate.model).__name__ == "NormswapGPT2LMHeadModel"
    assert text.startswith("Anne")
    assert not [m for m in messages if "not supported" in m], messages


def test_rotate_counts_and_calibration_bundled(tmp_path, capsys):
    """``--calibration bundled`` names the bundled text, as ``--text bundled`` does elsewhere."""
    out = tmp_path / "pca"
    code = main(["rotate", "normswap:austen-gpt2", "--out", str(out), "--method", "pca", "--calibration", "bundled",
                 "--calibration-tokens", "512", "--verify", "none", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "1 norm bias rotated" in printed or "norm biases rotated" in printed
    assert "1 norm biases" not in printed


@pytest.mark.slow
def test_geometry_prints_no_transformers_warnings(tmp_path):
    """The measured text is longer than the model's context on purpose (it is cut into windows)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    result = subprocess.run([sys.executable, "-m", "normswap.cli", "geometry", "normswap:austen-gpt2",
                             "--max-tokens", "600", "--seq-len", "128", "--no-progress"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "sequence length" not in result.stderr and "[transformers]" not in result.stderr, result.stderr
