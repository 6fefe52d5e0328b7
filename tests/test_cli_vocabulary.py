"""One vocabulary across commands.

``--json`` prints machine-readable output on stdout, and nothing else there, for every command;
``--out DIR`` takes report.json and report.md (and the plots with ``--plot``) for every command
that writes reports, under the same rules as every normswap output; ``--device`` defaults to
``auto`` (cuda when available, else cpu) wherever a command has it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import transformers as T
import yaml
from helpers import make_hard

from normswap.checkpoint import output
from normswap.checkpoint.source import example_model_path
from normswap.cli import build_parser, main
from normswap.commands import resolve_device

REPORT_COMMANDS = ("verify", "eval", "run", "geometry")
ALL_COMMANDS = ("convert", "rotate", "inspect", *REPORT_COMMANDS)


def quick_but_evaluation(commands: tuple[str, ...]) -> list:
    """eval and run load lm-eval and score two models; in the quick loop the other commands prove
    the same option handling, so those two run only in the full suite."""
    return [pytest.param(c, marks=pytest.mark.slow) if c in ("eval", "run") else c for c in commands]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GPT-2 with the bundled tokenizer, a short text, its conversion, and a recipe for it."""
    root = tmp_path_factory.mktemp("vocabulary")
    src = root / "src"
    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=2048,
                          bos_token_id=0, eos_token_id=0)
    make_hard(T.GPT2LMHeadModel(config)).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((example_model_path() / name).read_bytes())
    text = root / "short.txt"
    excerpt = (example_model_path().parent / "text" / "persuasion-excerpt.txt").read_text(encoding="utf-8")
    text.write_text(excerpt[20_000:21_500], encoding="utf-8")
    converted = root / "converted"
    assert main(["convert", str(src), "--out", str(converted), "--no-progress"]) == 0
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "tiny", "source": str(src), "convert": {"method": "exact"},
        "eval": {"dtype": "float32", "batch_size": 4, "max_length": 32, "text": str(text), "tasks": []},
    }))
    return {"src": src, "converted": converted, "text": text, "recipe": recipe}


def argv(command: str, tiny: dict, out) -> list[str]:
    """A quick invocation of ``command`` on the tiny model; ``out`` is a fresh folder."""
    src, converted, text = str(tiny["src"]), str(tiny["converted"]), str(tiny["text"])
    quick_eval = ["--text", text, "--max-length", "32", "--batch-size", "4", "--device", "cpu", "--no-progress"]
    return {
        "convert": ["convert", src, "--out", str(out), "--no-progress"],
        "rotate": ["rotate", src, "--out", str(out), "--no-progress"],
        "inspect": ["inspect", src],
        "verify": ["verify", src, converted, "--no-progress"],
        "eval": ["eval", converted, "--baseline", src, *quick_eval],
        "run": ["run", str(tiny["recipe"]), "--out", str(out), "--device", "cpu", "--no-progress"],
        "geometry": ["geometry", src, "--compare", converted, "--text", text, "--max-tokens", "128",
                     "--seq-len", "32", "--device", "cpu", "--no-progress"],
    }[command]


@pytest.mark.parametrize("command", quick_but_evaluation(ALL_COMMANDS))
def test_json_prints_only_json_on_stdout(command, tiny, tmp_path, capsys):
    args = argv(command, tiny, tmp_path / "out")
    assert main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # stdout is the JSON and nothing else
    assert isinstance(data, dict) and data
    assert "Traceback" not in captured.err
    if command in ("verify", "convert", "rotate"):
        verification = data if command == "verify" else data["verification"]
        assert verification["passed"] is True
    if command in ("eval", "run"):
        assert data["verdict"] == "pass"
    if command == "geometry":
        assert set(data) == {"original", "converted"}


@pytest.mark.parametrize("command", quick_but_evaluation(REPORT_COMMANDS))
def test_report_commands_write_reports_into_out(command, tiny, tmp_path, capsys):
    out = tmp_path / "reports"
    args = argv(command, tiny, out)
    if "--out" not in args:
        args += ["--out", str(out)]
    assert main([*args, "--plot"] if command != "verify" else args) == 0
    capsys.readouterr()
    assert json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text().startswith("# normswap")
    assert (out / output.MARKER).is_file()  # a normswap output: --overwrite may replace it later
    if command != "verify":
        assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    # a second run needs --overwrite, which replaces only what normswap wrote
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0


@pytest.mark.parametrize("command", REPORT_COMMANDS)
def test_out_owned_by_the_user_is_never_replaced(command, tiny, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    args = [a if a != str(tmp_path / "unused") else str(out) for a in argv(command, tiny, tmp_path / "unused")]
    if "--out" not in args:
        args += ["--out", str(out)]
    assert main([*args, "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not written by normswap" in err[0]
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("command", ALL_COMMANDS)
def test_json_is_a_switch_everywhere(command):
    parser, _ = build_parser(command)
    action = next(a for a in parser._subparsers._group_actions[0].choices[command]._actions if "--json" in a.option_strings)
    assert action.nargs == 0 and action.default is False


@pytest.mark.parametrize("command", ("eval", "run", "geometry"))
def test_device_defaults_to_auto(command, tiny):
    parser, _ = build_parser(command)
    sub = parser._subparsers._group_actions[0].choices[command]
    device = next(a for a in sub._actions if "--device" in a.option_strings)
    # run keeps the recipe's device when it names one, and is auto otherwise
    assert device.default == ("auto" if command != "run" else None)
    assert "auto" in device.help


def test_the_readme_names_the_commands_that_take_device():
    """The README's vocabulary paragraph says which commands take --device and which do not."""
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    takes = {command for command in ALL_COMMANDS
             if any("--device" in action.option_strings for action in subparser(command)._actions)}
    assert "`--device` (`eval`, `run` and `geometry`," in readme and takes == {"eval", "run", "geometry"}
    assert "while `convert`, `rotate`, `verify` and `inspect` work on the CPU in float64 and take no `--device`" in readme


def test_auto_is_cuda_when_available_else_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cpu") == "cpu"


def test_run_without_a_device_evaluates_on_auto(tiny, monkeypatch):
    import argparse

    from normswap.evaluation.recipe import load_recipe
    from normswap.evaluation.recipe_cli import _merged_settings

    parser = argparse.ArgumentParser()
    from normswap.evaluation.recipe_cli import configure

    configure(parser)
    args = parser.parse_args([str(tiny["recipe"])])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _merged_settings(load_recipe(tiny["recipe"]), args).device == "cpu"


# One spelling per option: the same flag, destination and help in every command that has it;
# older spellings parse the same but are not listed by --help.
PROGRESS_COMMANDS = ("convert", "rotate", "verify", "eval", "run", "geometry")
VERIFY_COMMANDS = ("convert", "rotate", "verify")


def subparser(command: str):
    parser, _ = build_parser(command)
    return parser._subparsers._group_actions[0].choices[command]


def option(command: str, flag: str):
    return next((a for a in subparser(command)._actions if flag in a.option_strings), None)


def test_every_command_that_shows_progress_has_the_same_switch():
    for command in ALL_COMMANDS:
        action = option(command, "--no-progress")
        assert (action is not None) == (command in PROGRESS_COMMANDS), command
    actions = [option(command, "--no-progress") for command in PROGRESS_COMMANDS]
    assert {(a.dest, a.nargs, a.default, a.help) for a in actions} == {
        (actions[0].dest, 0, False, actions[0].help)}
    for command in PROGRESS_COMMANDS:  # the old spelling: same destination, hidden
        quiet = option(command, "--quiet")
        assert quiet.dest == "no_progress" and quiet.help == argparse.SUPPRESS, command


def test_every_verifying_command_names_its_mode_with_verify():
    actions = {command: option(command, "--verify") for command in VERIFY_COMMANDS}
    for command, action in actions.items():
        assert action.dest == "verification" and action.default == "auto", command
        assert {"auto", "layerwise", "full"} <= set(action.choices), command
    assert set(actions["convert"].choices) == set(actions["rotate"].choices) == {*actions["verify"].choices, "none"}
    for flag, mode in (("--layerwise", "layerwise"), ("--full", "full")):
        alias = option("verify", flag)
        assert alias.help == argparse.SUPPRESS and alias.const == mode and alias.dest == "verification"


@pytest.mark.parametrize(("argv", "expected"), [
    (["verify", "a", "b"], {"verification": "auto", "no_progress": False}),
    (["verify", "a", "b", "--verify", "layerwise", "--no-progress"], {"verification": "layerwise", "no_progress": True}),
    (["verify", "a", "b", "--full", "--quiet"], {"verification": "full", "no_progress": True}),
    (["convert", "a", "--out", "x", "--quiet"], {"verification": "auto", "no_progress": True}),
    (["geometry", "a", "--no-progress"], {"no_progress": True}),
])
def test_old_and_new_spellings_parse_alike(argv, expected):
    parser, _ = build_parser(argv[0])
    args = parser.parse_args(argv)
    assert {key: getattr(args, key) for key in expected} == expected


def test_help_lists_only_the_current_spellings():
    for command in PROGRESS_COMMANDS:
        text = subparser(command).format_help()
        assert "--no-progress" in text and "--quiet" not in text, command
    text = subparser("verify").format_help()
    assert "--verify" in text and "--layerwise" not in text and "--full" not in text
    assert "normswap:austen-gpt2" in text  # verify takes normswap: names, as every command does


def test_bundled_names_the_bundled_text_everywhere():
    from normswap.evaluation.text import BUNDLED_TEXT

    parser, _ = build_parser("geometry")
    assert parser.parse_args(["geometry", "a", "--text", "bundled"]).text == BUNDLED_TEXT
    for flag in ("--calibration", "--held-out"):
        assert "'bundled'" in option("rotate", flag).help


@pytest.mark.parametrize(("argv", "named"), [
    (["convert", "normswap:austen-gpt2", "--ouy", "zz"], "--ouy"),  # named before "--out is required"
    (["convert", "normswap:austen-gpt2", "--out", "x", "--fold-gain"], "--fold-gain"),  # no abbreviation
    (["eval", "normswap:austen-gpt2", "--limi=3"], "--limi=3"),
])
def test_an_unknown_or_abbreviated_flag_is_named_first(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert f"normswap {argv[0]}: error: unrecognized arguments: {named} " in err[0] and "required" not in err[0]
