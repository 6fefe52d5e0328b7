"""Trust at the edges: permissions a recipe cannot grant, checkpoint files that point elsewhere,
removals that stay on their filesystem, interrupts, ambiguous weights, output kinds, task folders
that hold code, and a Python API that checks its arguments at the door."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import deep_tree, leftovers, make_hard, save
from test_hostile import Guard, assert_refused, run_cli
from transformers import GPT2Config, GPT2LMHeadModel

from normswap.checkpoint import output, temporaries
from normswap.errors import NormswapError


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny two-layer GPT-2 (safetensors, tied head), never modified by any test."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
    return save(make_hard(GPT2LMHeadModel(config)), tmp_path_factory.mktemp("edges") / "gpt2")


def copy_source(source: Path, tmp_path: Path, name: str = "src") -> Path:
    shutil.copytree(source, tmp_path / name, symlinks=True)
    return tmp_path / name


# ---------------------------------------------------------------------------------------------
# a recipe may narrow a permission, never grant it


def _recipe(tmp_path: Path, source: Path, convert: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps({"source": str(source), "convert": convert, "eval": {"tasks": []}}))
    return path


def test_recipe_cannot_grant_remote_code(source, tmp_path, capsys):
    src = copy_source(source, tmp_path)
    marker = tmp_path / "ran"
    (src / "custom_generate").mkdir()
    (src / "custom_generate" / "generate.py").write_text(f"open({str(marker)!r}, 'w')\n")
    recipe = _recipe(tmp_path, src, {"trust_remote_code": True})
    guard = Guard(tmp_path)
    code, _, err = run_cli(capsys, "run", recipe, "--out", tmp_path / "run", "--no-progress")
    assert_refused(code, err, "convert.trust_remote_code", "--trust-remote-code")
    assert not marker.exists()
    guard.unchanged()


def test_recipe_narrows_but_never_widens():
    from normswap.evaluation.recipe import Recipe, permitted

    def recipe(value):
        return Recipe(name="r", source="s", path=Path("r.yaml"), convert={} if value is None else
                      {"trust_remote_code": value})

    assert permitted(recipe(None), {"--trust-remote-code": True}) == {"trust_remote_code": True}
    assert permitted(recipe(False), {"--trust-remote-code": True}) == {"trust_remote_code": False}
    assert permitted(recipe(True), {"--trust-remote-code": True}) == {"trust_remote_code": True}
    assert permitted(recipe(None), {}) == {"trust_remote_code": False}
    with pytest.raises(NormswapError, match="--trust-remote-code"):
        permitted(recipe(True), {})


def test_run_recipe_api_refuses_a_granting_recipe(tmp_path):
    from normswap.evaluation.recipe import Recipe, run_recipe
    from normswap.evaluation.runner import EvalSettings

    recipe = Recipe(name="r", source="normswap:austen-gpt2", path=tmp_path / "r.yaml",
                    convert={"trust_remote_code": True})
    with pytest.raises(NormswapError, match="convert.trust_remote_code"):
        run_recipe(recipe, tmp_path / "out", settings=EvalSettings(), tolerances=None)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# every file read or copied from a checkpoint is a regular file inside it


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "generation_config.json",
                                  "preprocessor_config.json", "modeling_x.py", "model.safetensors"])
def test_link_out_of_the_checkpoint_is_refused(source, tmp_path, capsys, name):
    src = copy_source(source, tmp_path)
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps({"secret": "do not copy"}))
    if (src / name).exists():
        (src / name).unlink()
    (src / name).symlink_to(outside)
    guard = Guard(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--quiet")
    assert_refused(code, err, name, "outside the checkpoint")
    guard.unchanged()


def test_fifo_side_file_is_refused(source, tmp_path, capsys):
    src = copy_source(source, tmp_path)
    os.mkfifo(src / "tokenizer_config.json")
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--quiet")
    assert_refused(code, err, "tokenizer_config.json", "not a regular file")
    assert not (tmp_path / "out").exists()


def test_links_inside_the_checkpoint_and_hub_blobs_are_read(source, tmp_path, capsys):
    """The hub cache's layout: snapshot files linking to ../../blobs/ are inside."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for entry in source.iterdir():
        shutil.copyfile(entry, repo / "blobs" / entry.name)
        (snapshot / entry.name).symlink_to(Path("../../blobs") / entry.name)
    (snapshot / "tokenizer.json").symlink_to(Path("../../blobs") / "config.json")  # a link inside the repository
    code, _, err = run_cli(capsys, "convert", snapshot, "--out", tmp_path / "out", "--quiet", "--verify", "none")
    assert code == 0, err
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (source / "config.json").read_bytes()


# ---------------------------------------------------------------------------------------------
# ambiguous weights


def test_index_beside_a_single_file_is_ambiguous(source, tmp_path, capsys):
    src = copy_source(source, tmp_path)
    shutil.copyfile(src / "model.safetensors", src / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors"
                                            for name in json.loads(_header(src / "model.safetensors"))
                                            if name != "__metadata__"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--quiet")
    assert_refused(code, err, "model.safetensors", "model.safetensors.index.json", "ambiguous")


def test_safetensors_wins_over_a_disagreeing_bin_as_in_transformers(source, tmp_path, capsys):
    from normswap.checkpoint.source import _weight_shards

    src = copy_source(source, tmp_path)
    torch.save({"transformer.wte.weight": torch.zeros(50, 16)}, src / "pytorch_model.bin")
    assert _weight_shards(src) == ["model.safetensors"]
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--quiet")
    assert code == 0, err


def _header(path: Path) -> str:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return raw[8:8 + length].decode()


# ---------------------------------------------------------------------------------------------
# outputs: temporary markers, kinds, inputs inside --out


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    from normswap.cli import main

    out = tmp_path_factory.mktemp("edges-converted") / "rms"
    assert main(["convert", str(source), "--out", str(out), "--quiet", "--verify", "none"]) == 0
    return out


def _dead_pid() -> int:
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.parametrize("marker", [None, "wrong-token", "link"])
def test_folder_that_only_looks_temporary_is_kept(tmp_path, marker):
    out = tmp_path / "out"
    lookalike = tmp_path / f"out{temporaries.TMP_TAG}{_dead_pid()}-0-deadbeefdeadbeef"
    lookalike.mkdir()
    (lookalike / "thesis.tex").write_text("years of work")
    if marker == "wrong-token":
        (lookalike / temporaries.TMP_MARKER).write_text("cafecafecafecafe\n")
    elif marker == "link":
        (tmp_path / "token").write_text("deadbeefdeadbeef\n")
        (lookalike / temporaries.TMP_MARKER).symlink_to(tmp_path / "token")
    assert temporaries.remove_stale_temporaries(out) == []
    assert (lookalike / "thesis.tex").read_text() == "years of work"


def test_stale_temporary_with_its_marker_is_removed(tmp_path):
    out = tmp_path / "out"
    stale = tmp_path / f"out{temporaries.TMP_TAG}{_dead_pid()}-0-0123456789abcdef"
    stale.mkdir()
    (stale / temporaries.TMP_MARKER).write_text("0123456789abcdef\n")
    (stale / "model.safetensors").write_bytes(b"\0" * 64)
    assert temporaries.remove_stale_temporaries(out) == [stale]
    assert not stale.exists()


def test_a_fresh_temporary_is_marked_and_the_output_is_not(tmp_path):
    with output.claimed_output(tmp_path / "out", inputs=[], overwrite=False, kind="report") as claim:
        token = claim.tmp.name.rsplit("-", 1)[1]
        assert (claim.tmp / temporaries.TMP_MARKER).read_text().strip() == token
        claim.install()
    assert not (tmp_path / "out" / temporaries.TMP_MARKER).exists()
    assert output.marked_kind(tmp_path / "out") == "report"


def test_report_never_replaces_a_checkpoint(converted, tmp_path, capsys):
    guard = Guard(converted)
    code, _, err = run_cli(capsys, "eval", "normswap:austen-gpt2", "--out", converted, "--overwrite", "--no-progress")
    assert_refused(code, err, "checkpoint", "same kind")
    guard.unchanged()


def test_checkpoint_never_replaces_a_report(source, tmp_path, capsys):
    report = tmp_path / "report"
    with output.claimed_output(report, inputs=[], overwrite=False, kind="report") as claim:
        (claim.tmp / "report.json").write_text("{}")
        claim.install()
    code, _, err = run_cli(capsys, "convert", source, "--out", report, "--overwrite", "--quiet")
    assert_refused(code, err, "report", "same kind")
    assert (report / "report.json").read_text() == "{}"


@pytest.mark.parametrize("added", ["my-notes.txt", "sub/notes.txt", "unlisted-marker"])
def test_overwrite_refuses_an_output_holding_what_normswap_did_not_write(source, tmp_path, capsys, added):
    report = tmp_path / "report"
    with output.claimed_output(report, inputs=[], overwrite=False, kind="report") as claim:
        (claim.tmp / "sub").mkdir()
        (claim.tmp / "report.json").write_text("{}")
        claim.install()
    assert output.foreign_paths(report) == []
    if added == "unlisted-marker":  # a marker that lists nothing proves nothing
        (report / output.MARKER).write_text(json.dumps({"written_by": "normswap", "kind": "report"}))
    else:
        (report / added).write_text("mine")
    guard = Guard(report)
    code, _, err = run_cli(capsys, "eval", source, "--out", report, "--overwrite", "--no-progress")
    assert_refused(code, err, "normswap did not write", "report.json" if added == "unlisted-marker" else added)
    guard.unchanged()


def test_overwrite_walks_a_tree_of_any_depth(source, tmp_path, capsys):
    """A folder tree deeper than the interpreter's recursion limit in an output is someone else's,
    and is found as such (the walks keep their own stacks)."""
    report = tmp_path / "report"
    with output.claimed_output(report, inputs=[], overwrite=False, kind="report") as claim:
        (claim.tmp / "report.json").write_text("{}")
        claim.install()
    with deep_tree(report / "mine"):
        code, _, err = run_cli(capsys, "eval", source, "--out", report, "--overwrite", "--no-progress")
        assert_refused(code, err, "normswap did not write", "mine")
        assert (report / "mine" / "a" / "a").is_dir() and (report / "report.json").read_text() == "{}"


def test_removal_leaves_a_tree_deeper_than_it_can_descend(tmp_path):
    """Removing a tree deeper than the interpreter lets ``remove_tree`` descend is no internal
    error: the tree is reported as left in place (the limit is lowered here to make it so)."""
    import inspect
    import sys

    from normswap.checkpoint.removal import remove_tree

    with deep_tree(tmp_path / "out", depth=300) as root:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(len(inspect.stack()) + 100)
        try:
            left = remove_tree(root)
        finally:
            sys.setrecursionlimit(limit)
        assert left == [root] and root.is_dir()


@pytest.mark.parametrize("option", ["--text", "--audio", "--images"])
def test_eval_input_inside_out_is_refused(converted, tmp_path, capsys, option):
    out = tmp_path / "report"
    with output.claimed_output(out, inputs=[], overwrite=False, kind="report") as claim:
        (claim.tmp / "mine.txt").write_text("the user's text")
        claim.install()
    code, _, err = run_cli(capsys, "eval", converted, option, out / "mine.txt", "--out", out, "--overwrite",
                           "--no-progress")
    assert_refused(code, err, "input")
    assert (out / "mine.txt").read_text() == "the user's text"


def test_geometry_text_inside_out_is_refused(converted, tmp_path, capsys):
    out = tmp_path / "report"
    with output.claimed_output(out, inputs=[], overwrite=False, kind="report") as claim:
        (claim.tmp / "mine.txt").write_text("the user's text")
        claim.install()
    code, _, err = run_cli(capsys, "geometry", converted, "--text", out / "mine.txt", "--out", out, "--overwrite")
    assert_refused(code, err, "input")
    assert (out / "mine.txt").read_text() == "the user's text"


# ---------------------------------------------------------------------------------------------
# --overwrite never removes across filesystems


def _bind(source: Path, target: Path) -> bool:
    import subprocess

    target.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode == 0


def _unbind(target: Path) -> None:
    import subprocess

    subprocess.run(["umount", str(target)], capture_output=True)


def _tree(root: Path, files: dict[str, str]) -> Path:
    """``root`` holding ``files``, each a path relative to it and its text."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_overwrite_refuses_an_output_holding_a_bind_mount(source, converted, tmp_path, capsys):
    src = copy_source(source, tmp_path)
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    if not _bind(src, out / "mounted"):
        pytest.skip("bind mounts need root here")
    try:
        guard = Guard(src)
        code, _, err = run_cli(capsys, "convert", src, "--out", out, "--overwrite", "--quiet")
        assert_refused(code, err, "mount point")
        guard.unchanged()
        assert leftovers(tmp_path) == []
    finally:
        _unbind(out / "mounted")


def test_remove_tree_leaves_a_mount_in_place(tmp_path):
    from normswap.checkpoint.removal import remove_tree

    kept = _tree(tmp_path / "kept", {"precious": "x"})
    root = _tree(tmp_path / "root", {"a/file": "y"})
    if not _bind(kept, root / "a" / "mnt"):
        pytest.skip("bind mounts need root here")
    try:
        assert remove_tree(root) == [root / "a" / "mnt"]
        assert (kept / "precious").read_text() == "x"
        assert not (root / "a" / "file").exists()
    finally:
        _unbind(root / "a" / "mnt")


def test_remove_tree_stays_on_its_device_and_never_follows_links(tmp_path, monkeypatch):
    from normswap.checkpoint import removal

    outside = _tree(tmp_path / "outside", {"precious": "x"})
    root = _tree(tmp_path / "root", {"other-device/data": "z", "plain": "y"})
    (root / "link").symlink_to(outside)
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if str(path).endswith("other-device"):
            fields = list(result)
            fields[2] += 1  # st_dev
            return os.stat_result(fields)
        return result

    monkeypatch.setattr(removal.os, "stat", stat)
    assert removal.remove_tree(root) == [root / "other-device"]
    assert (root / "other-device" / "data").read_text() == "z"
    assert (outside / "precious").read_text() == "x"
    assert sorted(path.name for path in root.iterdir()) == ["other-device"]


# ---------------------------------------------------------------------------------------------
# interrupts: from the first line, twice in a row, and after the output is installed

_AFTER_INSTALL = """
import os, signal, sys
from normswap.checkpoint import output
installed = output.Claim.install
def install(self):
    installed(self)
    os.kill(os.getpid(), signal.SIGINT)
output.Claim.install = install
from normswap.cli import main
sys.exit(main())
"""


def _normswap(args: list, *, code: str | None = None):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "TQDM_DISABLE": "1"}
    command = [sys.executable, "-c", code, *map(str, args)] if code else [sys.executable, "-m", "normswap",
                                                                          *map(str, args)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as from a terminal, whatever ran the tests


@pytest.mark.parametrize("command", ["convert", "rotate"])
def test_interrupt_after_install_says_the_output_is_complete(source, tmp_path, command):
    out = tmp_path / "out"
    process = _normswap([command, source, "--out", out, "--quiet", "--verify", "none"], code=_AFTER_INSTALL)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"interrupted after the output was complete: {out} is installed "
                                                  "and whole")
    assert output.marked_kind(out) == "checkpoint" and (out / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


def test_interrupt_after_a_report_is_installed(source, tmp_path):
    out = tmp_path / "report"
    process = _normswap(["geometry", source, "--random-tokens", "--max-tokens", "16", "--seq-len", "8", "--out", out],
                        code=_AFTER_INSTALL)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "is installed and whole" in err.strip().splitlines()[-1]
    assert output.marked_kind(out) == "report"


_TERMINATED_MID_VERIFY = """
import os, signal, sys
from normswap.verify import checkpoint
compare = checkpoint.run_comparison
def run_comparison(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return compare(*args, **kwargs)
checkpoint.run_comparison = run_comparison
from normswap.cli import main
sys.exit(main())
"""


def test_sigterm_ends_a_command_that_writes_nothing_in_one_line(source, converted):
    process = _normswap(["verify", source, converted, "--quiet"], code=_TERMINATED_MID_VERIFY)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert err.strip().splitlines() == ["normswap verify: interrupted; nothing was written"], err


@pytest.mark.parametrize("delays", [(0.3,), (0.3, 0.02), (1.0, 0.02)])
def test_early_and_repeated_interrupts_are_one_line(source, tmp_path, delays):
    import signal
    import time

    out = tmp_path / "out"
    process = _normswap(["convert", source, "--out", out, "--quiet"])
    for delay in delays:
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = err.strip().splitlines()
    if process.returncode == 0:  # finished before the interrupt came
        return
    assert process.returncode == 130, err
    assert len(lines) == 1 and "interrupted" in lines[0], err
    assert leftovers(tmp_path) == [] and not out.exists()


# ---------------------------------------------------------------------------------------------
# a task folder is code


_TASK = """task: user_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: data.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{target}"
metric_list:
  - metric: word_perplexity
"""


def _task_folder(tmp_path: Path, target: str = "{{text}}", extra: str = "") -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "data.jsonl").write_text('{"text": "a b c"}\n')
    (folder / "task.yaml").write_text(_TASK.replace("{target}", target) + extra)
    return folder


@pytest.mark.parametrize("case", ["function", "include", "class", "jinja-globals", "jinja-attr", "jinja-concat",
                                  "metric-folder", "metric-hub", "hf-evaluate"])
def test_task_folder_code_needs_the_flag(tmp_path, monkeypatch, case):
    from normswap.evaluation.local_tasks import materialise_tasks

    marker = tmp_path / "ran"
    payload = tmp_path / "payload.py"
    payload.write_text(f"open({str(marker)!r}, 'w')\ndef f(x):\n    return x\n")
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"process_docs: !function {tmp_path / 'payload'}.f\n")
    target, extra = "{{text}}", ""
    if case == "function":
        extra = f"process_docs: !function {tmp_path / 'payload'}.f\n"
    elif case == "include":
        extra = f"include: {evil}\n"
    elif case == "class":
        extra = "class: payload.Task\n"
    elif case == "jinja-globals":
        target = "{{ cycler.__init__.__globals__.os.system('touch x') }}"
    elif case == "jinja-attr":
        target = "{{ text|attr('__class__') }}"
    elif case == "jinja-concat":
        target = "{{ text['__cla' ~ 'ss__'] }}"
    folder = _task_folder(tmp_path, target, extra)
    metric = {"metric-folder": f"metric: {tmp_path}", "metric-hub": "metric: org/metric",
              "hf-evaluate": "metric: word_perplexity\n    hf_evaluate: true"}.get(case)
    if metric:
        task = folder / "task.yaml"
        task.write_text(task.read_text().replace("metric: word_perplexity", metric))
    monkeypatch.setenv("NORMSWAP_EVALS_DIR", str(folder))
    with pytest.raises(NormswapError, match="--trust-remote-code") as refused:
        materialise_tasks(tmp_path / "work", ["user_task"])
    assert "task.yaml" in str(refused.value)
    assert not marker.exists()


def test_trusted_task_folder_keeps_its_code_beside_it(tmp_path, monkeypatch):
    import yaml

    from normswap.evaluation.local_tasks import materialise_tasks

    folder = _task_folder(tmp_path, extra="process_docs: !function utils.f\n")
    monkeypatch.setenv("NORMSWAP_EVALS_DIR", str(folder))
    work = materialise_tasks(tmp_path / "work", ["user_task"], trust_remote_code=True)
    written = yaml.safe_load((work / "task.yaml").read_text())
    assert written["include"] == str((folder / "task.yaml").resolve())
    assert written["dataset_kwargs"]["data_files"]["test"] == str((folder / "data.jsonl").resolve())


def test_plain_user_task_runs_without_the_flag_and_bundled_tasks_stay_trusted(tmp_path, monkeypatch):
    from normswap.evaluation.local_tasks import local_tasks, materialise_tasks

    monkeypatch.delenv("NORMSWAP_EVALS_DIR", raising=False)
    bundled = sorted(local_tasks())
    materialise_tasks(tmp_path / "bundled", bundled)
    monkeypatch.setenv("NORMSWAP_EVALS_DIR", str(_task_folder(tmp_path, "{{text.split(' ')[:-1]|join(' ')}}")))
    assert (materialise_tasks(tmp_path / "work", ["user_task"]) / "task.yaml").is_file()


def test_sandbox_stops_a_template_the_check_missed():
    from jinja2.exceptions import SecurityError
    from lm_eval import utils

    from normswap.evaluation.task_code import sandboxed_templates

    with sandboxed_templates(True), pytest.raises(SecurityError):
        utils.apply_template("{{ doc[key].__init__ }}", {"doc": {"k": ""}, "key": "k"})
    assert utils.apply_template("{{ a }}", {"a": "plain"}) == "plain"


@pytest.mark.parametrize("body", [
    "reference: {source: {a: 1}, figures: {a/b: 1.0}}",
    "reference: {source: x, figures: {1: 1.0}}",
    "reference: {source: x, figures: [a/b]}",
    "convert: {1: true, fold_gains: true}",
    "description: {a: [1, 2]}",
    "? [1, 2]\n: x",
])
def test_recipe_types_are_checked_when_read(tmp_path, body):
    from normswap.evaluation.recipe import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(f"source: {tmp_path}\n{body}\n")
    with pytest.raises(NormswapError, match="recipe"):
        load_recipe(path)


@pytest.mark.parametrize("device_map", ["{'':0}", "gpu:x"])
def test_a_bad_device_map_is_one_line_before_any_work(converted, capsys, device_map):
    from normswap.evaluation.runner import EvalSettings

    code, _, err = run_cli(capsys, "eval", converted, "--device-map", device_map, "--no-progress")
    assert_refused(code, err, "device_map")
    with pytest.raises(ValueError, match="device_map"):
        EvalSettings(device_map=device_map)


@pytest.mark.parametrize("kind", ["latin-1", "fifo"])
def test_eval_and_geometry_read_text_files_alike(converted, tmp_path, capsys, kind):
    text = tmp_path / "text.txt"
    if kind == "fifo":
        os.mkfifo(text)
    else:
        text.write_bytes("caf\xe9 au lait\n\n".encode("latin-1") * 50)
    needle = "not UTF-8" if kind == "latin-1" else "not a regular file"
    code, _, err = run_cli(capsys, "geometry", converted, "--text", text, "--out", tmp_path / "g")
    assert_refused(code, err, needle)
    code, _, err = run_cli(capsys, "eval", converted, "--text", text, "--no-progress")
    if kind == "latin-1":
        assert_refused(code, err, needle)
    assert not (tmp_path / "g").exists()


def test_a_limit_selects_whole_documents(converted, capsys):
    from types import SimpleNamespace

    from normswap.evaluation.lmeval import check_fraction
    from normswap.evaluation.runner import EvalSettings

    code, _, err = run_cli(capsys, "eval", converted, "--limit", "2.5", "--no-progress")
    assert_refused(code, err, "whole count")
    with pytest.raises(NormswapError, match="limit"):
        EvalSettings(limit=2.5)
    task = SimpleNamespace(eval_docs=list(range(40)), task_name="t\x00")
    with pytest.raises(NormswapError, match=r"one of the 40 documents of task 't\\x00'"):
        check_fraction(1e-300, [task])
    check_fraction(1 / 40, [task])
    check_fraction(3, [task])


@pytest.mark.parametrize(("shard", "reason"), [("a\x00b\x1b[2J.safetensors", "is not a file name"),
                                               ("x" * 5000 + ".safetensors", "missing weight file")],
                         ids=["control", "long"])
def test_untrusted_names_in_messages_are_escaped_and_capped(source, tmp_path, capsys, shard, reason):
    from safetensors import safe_open

    src = copy_source(source, tmp_path)
    (src / "model.safetensors").rename(src / "shard.safetensors")
    names = list(safe_open(src / "shard.safetensors", "pt").keys())
    weight_map = {name: "shard.safetensors" for name in names} | {names[0]: shard}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code, _, err = run_cli(capsys, "inspect", src)
    line = assert_refused(code, err, reason)
    assert "\x00" not in line and "\x1b" not in line and len(line) < 400


def test_a_long_unknown_task_list_is_one_short_line(converted, capsys):
    code, _, err = run_cli(capsys, "eval", converted, "--tasks", ",".join(f"zz{i}" for i in range(100_000)),
                           "--no-progress")
    line = assert_refused(code, err, "'zz0'", "99995 more")
    assert len(line) < 1000


def _bin_with_int_key(src: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save({**state, 1: torch.zeros(1)}, src / "pytorch_model.bin")


def _bin_index_naming_config(src: Path) -> None:
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"wte.weight": "config.json"}}))


def _config_from_a_device(src: Path) -> None:
    (src / "config.json").unlink()
    (src / "config.json").symlink_to("/dev/zero")


@pytest.mark.parametrize("change, needle", [
    (_bin_with_int_key, "the key 1 (int) is not a tensor name"),
    (_bin_index_naming_config, "config.json is not a PyTorch weight file"),
    (_config_from_a_device, "config.json that is not a regular file"),
], ids=["bin-int-key", "index-shard-config", "config-device"])
def test_messages_say_what_is_wrong(source, tmp_path, capsys, change, needle):
    src = copy_source(source, tmp_path)
    change(src)
    code, _, err = run_cli(capsys, "convert", src, "--out", tmp_path / "out", "--verify", "none", "--quiet")
    assert_refused(code, err, needle)


def test_out_on_a_virtual_filesystem_or_a_mount_point_is_refused_up_front(source, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", source, "--out", "/proc/normswap-out", "--quiet")
    assert_refused(code, err, "stores no files")
    mounted = tmp_path / "mounted"
    if not _bind(copy_source(source, tmp_path, "elsewhere"), mounted):
        pytest.skip("bind mounts need root here")
    try:
        code, _, err = run_cli(capsys, "convert", source, "--out", mounted, "--overwrite", "--quiet")
        assert_refused(code, err, "is a mount point")
    finally:
        _unbind(mounted)


# ---------------------------------------------------------------------------------------------
# the Python API checks its arguments at the door


@pytest.fixture(scope="module")
def tiny_model(source):
    return GPT2LMHeadModel.from_pretrained(source)


def _api_calls(source, converted, tiny_model, tmp_path):
    import normswap
    from normswap.evaluation.api import evaluate
    from normswap.evaluation.runner import EvalSettings

    linear = torch.nn.Linear(2, 2)
    return {
        # wrong types: TypeError naming the parameter
        "save-None": (TypeError, "folder", lambda: normswap.save(normswap.convert_model(tiny_model), None)),
        "save-int": (TypeError, "folder", lambda: normswap.save(normswap.convert_model(tiny_model), 5)),
        "save-overwrite": (TypeError, "overwrite", lambda: normswap.save(tiny_model, tmp_path / "x", overwrite="yes")),
        "settings-tasks-str": (TypeError, "tasks", lambda: EvalSettings(tasks="local")),
        "settings-batch-str": (TypeError, "batch_size", lambda: EvalSettings(batch_size="8")),
        "settings-tasks-ints": (TypeError, "tasks", lambda: EvalSettings(tasks=[1, 2])),
        "settings-progress": (TypeError, "progress", lambda: EvalSettings(progress=1)),
        "fold-gains-str": (TypeError, "fold_gains", lambda: normswap.convert_model(tiny_model, fold_gains="yes")),
        "load-None": (TypeError, "path", lambda: normswap.load(None)),
        "load-dtype-int": (TypeError, "dtype", lambda: normswap.load(converted, dtype=5)),
        "load-model-None": (TypeError, "src", lambda: normswap.load_model(None)),
        "load-model-trust": (TypeError, "trust_remote_code", lambda: normswap.load_model(converted,
                                                                                          trust_remote_code="no")),
        "convert-model-None": (TypeError, "model", lambda: normswap.convert_model(None)),
        "convert-model-linear": (TypeError, "model", lambda: normswap.convert_model(linear)),
        "patch-str": (TypeError, "model", lambda: normswap.patch("x")),
        "convert-checkpoint-int": (TypeError, "src", lambda: normswap.convert_checkpoint(123, tmp_path / "o")),
        "convert-checkpoint-out": (TypeError, "out", lambda: normswap.convert_checkpoint(source, None)),
        "convert-checkpoint-flag": (TypeError, "fold_gains", lambda: normswap.convert_checkpoint(
            source, tmp_path / "o", fold_gains=1)),
        "rotate-seed": (TypeError, "seed", lambda: normswap.rotate_checkpoint(source, tmp_path / "o", seed="0")),
        "verify-None": (TypeError, "original", lambda: normswap.verify_checkpoint(None, None)),
        "verify-layerwise": (TypeError, "layerwise", lambda: normswap.verify_checkpoint(source, converted,
                                                                                        layerwise="yes")),
        "evaluate-None": (TypeError, "model", lambda: evaluate(None)),
        "evaluate-settings": (TypeError, "settings", lambda: evaluate(str(converted), settings={"batch_size": 8})),
        # wrong values: NormswapError or ValueError saying why
        "load-device-map": (ValueError, "device_map", lambda: normswap.load(converted, device_map="evil")),
        "load-dtype-name": (NormswapError, "dtype", lambda: normswap.load(converted, dtype="float13")),
        "convert-model-method": (NormswapError, "method", lambda: normswap.convert_model(tiny_model, method="magic")),
        "settings-batch-zero": (NormswapError, "batch_size", lambda: EvalSettings(batch_size=0)),
        "settings-limit-inf": (NormswapError, "limit", lambda: EvalSettings(limit=float("inf"))),
        "settings-dtype": (NormswapError, "float13", lambda: EvalSettings(dtype="float13")),
        "convert-checkpoint-method": (NormswapError, "naive", lambda: normswap.convert_checkpoint(
            source, tmp_path / "o", method="naive")),
        "convert-checkpoint-atol": (NormswapError, "atol", lambda: normswap.convert_checkpoint(
            source, tmp_path / "o", atol=float("nan"))),
        "convert-checkpoint-int8": (NormswapError, "torch.int8", lambda: normswap.convert_checkpoint(
            source, tmp_path / "o", dtype=torch.int8)),
        "load-int8": (NormswapError, "torch.int8", lambda: normswap.load(converted, dtype=torch.int8)),
        "convert-checkpoint-missing": (NormswapError, "absent", lambda: normswap.convert_checkpoint(
            tmp_path / "absent", tmp_path / "o")),
        "save-not-converted": (NormswapError, "convert_model", lambda: normswap.save(tiny_model, tmp_path / "x")),
    }


CALLS = ["save-None", "save-int", "save-overwrite", "settings-tasks-str", "settings-batch-str", "settings-tasks-ints",
         "settings-progress", "fold-gains-str", "load-None", "load-dtype-int", "load-model-None", "load-model-trust",
         "convert-model-None", "convert-model-linear", "patch-str", "convert-checkpoint-int", "convert-checkpoint-out",
         "convert-checkpoint-flag", "rotate-seed", "verify-None", "verify-layerwise", "evaluate-None",
         "evaluate-settings", "load-device-map", "load-dtype-name", "convert-model-method", "settings-batch-zero",
         "settings-limit-inf", "settings-dtype", "convert-checkpoint-method", "convert-checkpoint-atol",
         "convert-checkpoint-missing", "save-not-converted", "convert-checkpoint-int8", "load-int8"]


@pytest.mark.parametrize("case", CALLS)
def test_public_api_checks_arguments(source, converted, tiny_model, tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    error, needle, call = _api_calls(source, converted, tiny_model, tmp_path)[case]
    with pytest.raises(error, match=needle) as raised:
        call()
    if error is TypeError:
        assert "must be" in str(raised.value) or "list of" in str(raised.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # nothing written, no ./None or ./5


def test_convert_model_refuses_a_nan_gain(tiny_model):
    import copy

    import normswap

    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight[3] = float("nan")
    with pytest.raises(NormswapError, match=r"h\.0\.ln_1\.weight.*NaN"):
        normswap.convert_model(model)


def test_api_edge_values_are_accepted(source, tiny_model, tmp_path):
    import normswap
    from normswap.evaluation.runner import EvalSettings

    assert EvalSettings(limit=0.5, tasks=[], batch_size=1).limit == 0.5
    converted = normswap.convert_model(tiny_model, fold_gains=True)
    normswap.save(converted, Path(tmp_path / "saved"))
    normswap.save(converted, str(tmp_path / "saved"), overwrite=True)
    assert normswap.patch(converted) is converted
    assert isinstance(normswap.load(tmp_path / "saved", dtype=torch.float64, device_map="cpu"), torch.nn.Module)


@pytest.mark.parametrize("case", ["x-list", "weight-shape", "bias-type", "eps-nan", "eps-str", "x-scalar"])
def test_rms_norm_checks_its_arguments(case):
    from normswap.kernels import rms_norm

    x = torch.randn(2, 4)
    error, call = {
        "x-list": (TypeError, lambda: rms_norm([1.0, 2.0])),
        "weight-shape": (ValueError, lambda: rms_norm(x, torch.ones(3))),
        "bias-type": (TypeError, lambda: rms_norm(x, torch.ones(4), bias=0.5)),
        "eps-nan": (ValueError, lambda: rms_norm(x, eps=float("nan"))),
        "eps-str": (TypeError, lambda: rms_norm(x, eps="1e-5")),
        "x-scalar": (ValueError, lambda: rms_norm(torch.tensor(1.0))),
    }[case]
    with pytest.raises(error, match="rms_norm"):
        call()


def test_run_refuses_a_recipe_text_inside_its_out(source, tmp_path, capsys):
    out = tmp_path / "run"
    with output.claimed_output(out, inputs=[], overwrite=False, kind="run") as claim:
        (claim.tmp / "notes.txt").write_text("the user's text")
        claim.install()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"source": str(source), "eval": {"text": str(out / "notes.txt"), "tasks": []}}))
    code, _, err = run_cli(capsys, "run", recipe, "--out", out, "--overwrite", "--no-progress")
    assert_refused(code, err, "input")
    assert (out / "notes.txt").read_text() == "the user's text"


def test_an_interrupted_stale_removal_keeps_the_marker_until_last(tmp_path, monkeypatch):
    from normswap.checkpoint import removal

    stale = tmp_path / "stale"
    stale.mkdir()
    for name in ("a", temporaries.TMP_MARKER, "b"):
        (stale / name).write_text(name)
    order = []
    unlink = os.unlink

    def recording(name, *args, **kwargs):
        order.append(name)
        return unlink(name, *args, **kwargs)

    monkeypatch.setattr(removal.os, "unlink", recording)
    assert removal.remove_tree(stale, last=temporaries.TMP_MARKER) == []
    assert order[-1] == temporaries.TMP_MARKER and not stale.exists()


@pytest.mark.parametrize("command", ["verify", pytest.param("eval", marks=pytest.mark.slow)])
def test_interrupt_after_a_report_of_verify_or_eval(source, converted, tmp_path, command):
    out = tmp_path / "report"
    args = {"verify": ["verify", source, converted, "--quiet"],
            "eval": ["eval", "normswap:austen-gpt2", "--max-length", "64", "--no-progress"]}[command]
    process = _normswap([*args, "--out", out], code=_AFTER_INSTALL)
    _, err = process.communicate(timeout=600)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"{out} is installed and whole")
    assert output.marked_kind(out) == "report"
