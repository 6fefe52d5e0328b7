"""The command line starts without torch, transformers or lm-eval, and refuses bad input before
importing them; missing extras are named in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from normswap import cli, extras

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "lm_eval", "matplotlib", "triton")


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-X", "importtime"] + (["-c", code] if code else ["-m", "normswap", *args])
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def _imported(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def _messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:") and line.strip()]


def test_import_normswap_cli_imports_no_heavy_module():
    result = _run(code="import normswap.cli, normswap, sys; "
                       "print(sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["convert", "--help"], ["eval", "--help"],
                                  ["geometry", "--help"], ["run", "--help"], ["verify", "--help"]])
def test_help_and_version_import_no_heavy_module(args):
    result = _run(*args)
    assert result.returncode == 0, result.stderr
    assert not _imported(result.stderr) & set(HEAVY)


@pytest.mark.parametrize("args", [
    ["convert", "/no/such/checkpoint", "--out", "/tmp/normswap-never-written"],
    ["inspect", "/no/such/checkpoint"],
    ["verify", "/no/such/checkpoint", "/no/such/converted"],
    ["eval", "/no/such/checkpoint"],
    ["eval", "normswap:austen-gpt2", "--baseline", "/no/such/checkpoint"],
    ["geometry", "/no/such/checkpoint"],
    ["run", "/no/such/recipe.yaml"],
])
def test_bad_path_fails_in_one_line_before_heavy_imports(args):
    result = _run(*args)
    assert result.returncode == 2
    messages = _messages(result.stderr)
    assert len(messages) == 1 and "/no/such/" in messages[0], messages
    assert not _imported(result.stderr) & set(HEAVY)
    assert not Path("/tmp/normswap-never-written").exists()


@pytest.mark.parametrize("args", [["convert", "normswap:austen-gpt2", "--no-such-flag"], ["no-such-command"],
                                  ["geometry", "normswap:austen-gpt2", "--dtype", "float99"]])
def test_bad_flag_fails_before_heavy_imports(args):
    result = _run(*args)
    assert result.returncode == 2
    assert not _imported(result.stderr) & set(HEAVY)


@pytest.mark.slow
def test_transformers_imported_after_normswap_knows_the_normswap_model_types():
    result = _run(code="import normswap, transformers; print('normswap_bloom' in transformers.CONFIG_MAPPING)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


@pytest.mark.slow
def test_normswap_imported_after_transformers_registers_at_once():
    result = _run(code="import transformers, normswap; print('normswap_bloom' in transformers.CONFIG_MAPPING)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_public_names_resolve_lazily():
    import normswap

    for name in normswap.__all__:
        assert getattr(normswap, name) is not None
    with pytest.raises(AttributeError):
        normswap.no_such_name  # noqa: B018


def test_require_names_the_extra_and_the_install_command(monkeypatch):
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(extras.NormswapError) as caught:
        extras.require("eval", "normswap eval")
    message = str(caught.value)
    assert "\n" not in message
    assert "'eval' extra" in message and "pip install 'normswap[eval]'" in message and "lm-eval" in message


def test_require_passes_when_installed(monkeypatch):
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: object())
    extras.require("plot", "a plot")


@pytest.mark.parametrize(("args", "extra"), [
    (["eval", "normswap:austen-gpt2"], "eval"),
    (["run", "austen-gpt2"], "eval"),
    (["geometry", "normswap:austen-gpt2", "--out", "/tmp/normswap-never-written", "--plot"], "plot"),
])
def test_command_without_its_extra_prints_one_line(monkeypatch, capsys, args, extra):
    monkeypatch.setattr(extras, "missing", lambda name: ["some-dist"] if name == extra else [])
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pip install 'normswap[{extra}]'" in err[0], err


def test_core_dependencies_leave_evaluation_plots_and_kernels_to_extras():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for heavy in ("lm-eval", "matplotlib", "triton", "pandas", "scipy", "pyarrow"):
        assert heavy not in core
    optional = project["optional-dependencies"]
    assert {"eval", "plot", "kernels", "all", "test"} <= set(optional)
    assert any("lm-eval" in dep for dep in optional["eval"])
    assert any("triton" in dep for dep in optional["kernels"])
    assert any("eval" in dep and "plot" in dep for dep in optional["test"])


def test_recipe_with_a_bad_source_fails_before_heavy_imports(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("source: /no/such/checkpoint\n")
    result = _run("run", str(recipe), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    messages = _messages(result.stderr)
    assert len(messages) == 1 and "/no/such/checkpoint" in messages[0], messages
    assert not _imported(result.stderr) & set(HEAVY)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_public_api_use_registers_the_normswap_model_types():
    result = _run(code="from normswap import convert_checkpoint; import transformers; "
                       "print('normswap_bloom' in transformers.CONFIG_MAPPING)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
