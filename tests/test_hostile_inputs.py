"""Hostile inputs, by the mechanism that refuses them: the bounded reader of JSON and YAML files,
the checks of side files against the model, the dtype policy of weight headers, the config keys
that steer the libraries, checkpoints with no usable weights, and the CLI's last line of defence.

Every case runs the real CLI in-process (``normswap.cli.main``) and asserts one line on stderr
naming the problem, a non-zero exit, no traceback, never the last-resort "internal error" line,
and that nothing was written. Most cases are refused before torch work starts.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import tiny_gpt2

from normswap import cli
from normswap.checkpoint import bounded
from normswap.cli import main
from normswap.errors import NormswapError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "normswap" / "data" / "austen-gpt2"


# ---------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny two-layer GPT-2 (safetensors, tied head, vocabulary of 50), never modified."""
    return tiny_gpt2(tmp_path_factory.mktemp("inputs") / "gpt2")


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    """Tiny Whisper, ViT and CLIP checkpoints with their own processors."""
    from media_models import tiny_clip, tiny_vit, tiny_whisper

    root = tmp_path_factory.mktemp("media")
    return {"whisper": tiny_whisper(root / "whisper"), "vit": tiny_vit(root / "vit"), "clip": tiny_clip(root / "clip")}


def copy(folder: Path, tmp_path: Path, name: str = "src") -> Path:
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def refused(capsys, tmp_path: Path, *args, needle: str, exit_code: int = 2) -> str:
    """Run the CLI: one line on stderr naming ``needle``, exit ``exit_code``, never the last-resort
    line, and no new entry in ``tmp_path`` (nothing written beside the inputs)."""
    before = sorted(path.name for path in tmp_path.iterdir())
    code = main([str(arg) for arg in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and cli.INTERNAL_ERROR not in err, err
    assert code == exit_code, (code, err)
    assert needle in lines[0], lines[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == before
    return lines[0]


def edit_json(path: Path, **values) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(values)
    path.write_text(json.dumps(data))


def rewrite_header(path: Path, change) -> None:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header, data = change(json.loads(raw[8:8 + length]), raw[8 + length:])
    encoded = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def with_tokenizer(folder: Path) -> Path:
    """``folder`` with the bundled example's tokenizer (2048 ids), which a 50-id model cannot read."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(EXAMPLE / name, folder / name)
    return folder


# ---------------------------------------------------------------------------------------------
# 1. one bounded reader for every JSON file a command or a library reads

DEEP = "[" * 5000 + "]" * 5000
JSON_PROBLEMS = {
    "deep-nesting": ('{"a": ' + DEEP + "}", "nested more than"),
    "nesting-just-past-the-cap": ('{"a": ' + "[" * 70 + "]" * 70 + "}", "nested more than"),
    "5000-digit-integer": ('{"a": ' + "7" * 5000 + "}", "an integer of 5000 digits"),
    "50-digit-integer": ('{"a": -' + "7" * 50 + "}", "an integer of 50 digits"),
    "top-level-list": ("[1, 2]", "must hold a JSON object, not an array"),
    "top-level-null": ("null", "must hold a JSON object, not null"),
    "top-level-string": ('"x"', "must hold a JSON object, not a string"),
    "not-utf8": (b'{"a": "caf\xe9"}', "not UTF-8"),
    "not-json": ("{'a': 1}", "not valid JSON"),
    "empty": ("", "not valid JSON"),
    "byte-order-mark": (b'\xef\xbb\xbf{"a": 1}', "not valid JSON"),
    "utf-16": ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
}
SIDE_FILES = ["config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
              "preprocessor_config.json", "added_tokens.json", "tokenizer.json"]


# tokenizer.json is parsed within bounds but not walked to 64 levels: its own parser stops at 128
JSON_CASES = [(name, problem) for name in SIDE_FILES for problem in JSON_PROBLEMS
              if (name, problem) != ("tokenizer.json", "nesting-just-past-the-cap")]


@pytest.mark.parametrize(("name", "problem"), JSON_CASES)
def test_json_side_files_are_read_within_bounds(source, tmp_path, capsys, name, problem):
    content, needle = JSON_PROBLEMS[problem]
    src = copy(source, tmp_path)
    (src / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    line = refused(capsys, tmp_path, "inspect", src, needle=needle)
    assert name in line


def test_unprintable_text_from_a_file_is_printed_escaped(source, tmp_path, capsys):
    src = copy(source, tmp_path)
    (src / "config.json").write_text('{"model_type": "x\\ud800y"}')  # a lone surrogate
    refused(capsys, tmp_path, "inspect", src, needle="x\\ud800y")


def test_verify_reads_the_converted_side_files_first(source, tmp_path, capsys):
    converted = tmp_path / "rms"
    assert main(["convert", str(source), "--out", str(converted), "--verify", "none", "--quiet"]) == 0
    (converted / "generation_config.json").write_text('{"a": ' + DEEP + "}")
    refused(capsys, tmp_path, "verify", source, converted, needle="rms/generation_config.json: nested more than")


@pytest.mark.parametrize("command", ["convert", "eval", "geometry", "rotate", "verify"])
def test_every_command_reads_side_files_first(source, tmp_path, capsys, command):
    src = copy(source, tmp_path)
    (src / "generation_config.json").write_text('{"a": ' + DEEP + "}")
    out = tmp_path / "out"
    args = {"convert": ["convert", src, "--out", out], "eval": ["eval", src], "geometry": ["geometry", src],
            "rotate": ["rotate", src, "--out", out], "verify": ["verify", src, source]}[command]
    refused(capsys, tmp_path, *args, needle="generation_config.json: nested more than")


@pytest.mark.parametrize("marker", ["[" * 4096, '{"kind": ' + "9" * 5000 + "}"])
def test_a_hostile_output_marker_is_a_marker_of_no_kind(source, tmp_path, capsys, marker):
    from normswap.checkpoint.output import MARKER

    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text(marker)
    (out / "user-file").write_text("mine")
    refused(capsys, tmp_path, "convert", source, "--out", out, "--overwrite", needle="--overwrite only replaces")
    assert (out / "user-file").read_text() == "mine"


def test_oversized_side_file(source, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bounded, "MAX_BYTES", 1024)
    src = copy(source, tmp_path)
    (src / "tokenizer_config.json").write_text(json.dumps({"pad": "x" * 4096}))
    refused(capsys, tmp_path, "inspect", src, needle="larger than")


def _sharded(source: Path, tmp_path: Path, index_name: str) -> Path:
    """The source as two shards (safetensors, or .bin for a .bin index) with an index."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "sharded"
    src.mkdir()
    shutil.copyfile(source / "config.json", src / "config.json")
    state = load_file(source / "model.safetensors")
    names = sorted(state)
    suffix = "safetensors" if "safetensors" in index_name else "bin"
    weight_map = {}
    for part, part_names in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
        shard = f"model-0000{part}-of-00002.{suffix}"
        tensors = {name: state[name] for name in part_names}
        if suffix == "safetensors":
            save_file(tensors, src / shard, metadata={"format": "pt"})
        else:
            torch.save(tensors, src / shard)
        weight_map.update(dict.fromkeys(part_names, shard))
    (src / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src


@pytest.mark.parametrize("metadata", ["missing", "list", "string"])
@pytest.mark.parametrize("index_name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
def test_index_metadata_is_a_mapping(source, tmp_path, capsys, index_name, metadata):
    src = _sharded(source, tmp_path, index_name)
    index = json.loads((src / index_name).read_text())
    if metadata == "missing":
        del index["metadata"]
    else:
        index["metadata"] = [] if metadata == "list" else "x"
    (src / index_name).write_text(json.dumps(index))
    refused(capsys, tmp_path, "eval", src, "--no-progress", needle="'metadata' must be a mapping")


@pytest.mark.parametrize("index", ['{"weight_map": ' + DEEP + "}", '{"metadata": {"total_size": ' + "9" * 5000 + "}}",
                                   '{"metadata": {}, "weight_map": {}}'])
def test_index_read_within_bounds(source, tmp_path, capsys, index):
    src = _sharded(source, tmp_path, "model.safetensors.index.json")
    (src / "model.safetensors.index.json").write_text(index)
    refused(capsys, tmp_path, "inspect", src, needle="model.safetensors.index.json")


@pytest.mark.parametrize("case", ["deep-metadata", "long-integer", "not-utf8"])
def test_safetensors_header_read_within_bounds(source, tmp_path, capsys, case):
    src = copy(source, tmp_path)

    def change(header, data):
        if case == "deep-metadata":
            return json.dumps({**header, "__metadata__": {"a": "x"}}).replace('"x"', DEEP).encode(), data
        if case == "long-integer":
            return json.dumps(header).replace('"data_offsets": [0,', '"data_offsets": [' + "0" * 5000 + ",").encode(), data
        return b'{"a": "\xe9"}', data

    rewrite_header(src / "model.safetensors", change)
    refused(capsys, tmp_path, "inspect", src, needle="unreadable header")


def test_null_safetensors_metadata_is_none(source, tmp_path, capsys):
    """The safetensors library reads a null ``__metadata__`` as none, and so does normswap."""
    src = copy(source, tmp_path)
    rewrite_header(src / "model.safetensors",
                   lambda header, data: (json.dumps({**header, "__metadata__": None}).encode(), data))
    assert main(["inspect", str(src)]) == 0


@pytest.mark.parametrize(("metadata", "needle"), [([1], "is an array"), ({"format": "pt", "x": {"y": [1]}},
                                                                          "maps 'x' to an object")])
def test_safetensors_metadata_maps_strings_to_strings(source, tmp_path, capsys, metadata, needle):
    """The safetensors library refuses any other ``__metadata__`` when a loader opens the file,
    so convert refuses it before writing."""
    src = copy(source, tmp_path)
    rewrite_header(src / "model.safetensors",
                   lambda header, data: (json.dumps({**header, "__metadata__": metadata}).encode(), data))
    refused(capsys, tmp_path, "convert", src, "--out", tmp_path / "out", needle=needle)


# ---------------------------------------------------------------------------------------------
# 6. recipes and task YAML through the same reader

ALIAS_BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
RECIPE_PROBLEMS = {
    "alias-bomb": (ALIAS_BOMB + "source: normswap:austen-gpt2\n", "expands to more than"),
    "many-aliases": ("x: &x 1\ny: [" + ", ".join(["*x"] * 1200) + "]\nsource: normswap:austen-gpt2\n", "YAML aliases"),
    "deep-nesting": ("source: normswap:austen-gpt2\nname: " + DEEP + "\n", "nested more than"),
    "deep-block-nesting": ("source: normswap:austen-gpt2\n" + "".join(f"{' ' * i}k{i}:\n" for i in range(80)) + " " * 80 + "v: 1\n",
                           "nested more than"),
    "limit-1e308": ("source: normswap:austen-gpt2\neval:\n  limit: 1.0e+308\n", "eval.limit 1e+308 is more documents"),
    "limit-1e308-yaml-1.1": ("source: normswap:austen-gpt2\neval:\n  limit: 1e308\n", "eval.limit 1e+308 is more documents"),
    "limit-inf": ("source: normswap:austen-gpt2\neval:\n  limit: .inf\n", "eval.limit must be a positive number"),
    "5000-digit-integer": ("source: normswap:austen-gpt2\neval:\n  batch_size: " + "9" * 5000 + "\n", "cannot read recipe"),
    "60-digit-integer": ("source: normswap:austen-gpt2\neval:\n  batch_size: " + "9" * 60 + "\n", "an integer of more than"),
    "not-utf8": ("source: normswap:austen-gpt2\ndescription: caf\xe9\n".encode("latin-1"), "not UTF-8"),
    "python-tag": ("source: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    "top-level-list": ("- source\n", "must be a YAML mapping"),
    "empty": ("", "must be a YAML mapping"),
    "nul-character": ("name: x\x00\nsource: normswap:austen-gpt2\n", "not valid YAML"),
}


@pytest.mark.parametrize("problem", list(RECIPE_PROBLEMS))
def test_recipe_read_within_bounds(tmp_path, capsys, problem):
    content, needle = RECIPE_PROBLEMS[problem]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(content if isinstance(content, bytes) else content.encode())
    refused(capsys, tmp_path, "run", recipe, "--out", tmp_path / "out", needle=needle)


def _task_folder(tmp_path: Path, change=None, raw: bytes | None = None) -> Path:
    folder = tmp_path / "evals"
    shutil.copytree(ROOT / "normswap" / "evals", folder)
    task = folder / "persuasion_lastword.yaml"
    if raw is not None:
        task.write_bytes(raw)
    elif change is not None:
        task.write_text(change(task.read_text()))
    return folder


def _generating(text: str, max_gen_toks: int) -> str:
    return (text.replace("output_type: loglikelihood", "output_type: generate_until")
            + f"generation_kwargs: {{until: ['\\n'], max_gen_toks: {max_gen_toks}}}\n")


def _template(text: str, template: str) -> str:
    lines = text.splitlines()
    return "\n".join(f'doc_to_text: "{template}"' if line.startswith("doc_to_text:") else line for line in lines) + "\n"


TASK_PROBLEMS = {
    "missing-data-file": (lambda text: text.replace("data/persuasion_lastword.jsonl", "data/absent.jsonl"),
                          "does not exist"),
    "class-string": (lambda text: text + "class: os.system\n", "a task folder is code"),
    "filter_list-string": (lambda text: text + "filter_list: strip\n", "'filter_list' must be a list"),
    "filter_list-entries": (lambda text: text + "filter_list: [strip]\n", "every entry of 'filter_list'"),
    "metric_list-entries": (lambda text: text + "metric_list: [perplexity]\n", "every entry of 'metric_list'"),
    "unknown-key": (lambda text: text + "doc_to_txt: x\n", "'doc_to_txt' is not a key"),
    "output_type": (lambda text: text.replace("output_type: loglikelihood", "output_type: exec"), "'output_type' must be"),
    "num_fewshot-string": (lambda text: text + "num_fewshot: '5'\n", "'num_fewshot' must be an integer"),
    "aggregation-unregistered": (lambda text: text.replace("aggregation: mean", "aggregation: nonexistent_agg"),
                                 "is not one lm-eval registers"),
    "filter-unregistered": (lambda text: text + "filter_list: [{name: x, filter: [{function: nofilter}]}]\n",
                            "the filter 'nofilter' is not one lm-eval registers"),
    "custom-filter-string": (lambda text: text + "filter_list: [{name: x, filter: [{function: custom, "
                             "filter_fn: os.system}]}]\n", "'filter_fn' must be Python code (a !function tag)"),
    "max_gen_toks-huge": (lambda text: _generating(text, 10**12), "'max_gen_toks' must be an integer from 1 to"),
    "template-repetition": (lambda text: _template(text, "{{ 'a' * 100000000000 }}"),
                            "a task template builds a repetition of 100,000,000,000 items"),
    "template-output": (lambda text: _template(text, "{% for i in range(100000) %}{{ 'a' * 999 }}{% endfor %}"),
                        "characters of output"),
    "alias-bomb": (lambda text: text + ALIAS_BOMB.replace("a:", "x_a:", 1), "cannot read task file"),
}


@pytest.mark.parametrize("problem", [*TASK_PROBLEMS, "not-utf8"])
def test_task_yaml_checked_before_lm_eval_builds_it(tmp_path, capsys, monkeypatch, problem):
    if problem == "not-utf8":
        folder, needle = _task_folder(tmp_path, raw="task: persuasion_lastword\ndescription: caf\xe9\n".encode("latin-1")), "not UTF-8"
    else:
        change, needle = TASK_PROBLEMS[problem]
        folder = _task_folder(tmp_path, change)
    if problem.startswith("template"):  # rendered once datasets has read the data: its bars, imported
        # by earlier tests in this process, no longer read the TQDM_DISABLE that --no-progress sets
        monkeypatch.setattr(importlib.import_module("datasets.utils.tqdm"), "_hf_datasets_progress_bars_disabled", True)
    monkeypatch.setenv("NORMSWAP_EVALS_DIR", str(folder))
    refused(capsys, tmp_path, "eval", "normswap:austen-gpt2", "--tasks", "persuasion_lastword", "--no-perplexity",
            "--limit", "4", "--no-progress", needle=needle)


def test_max_gen_toks_must_leave_room_for_a_prompt():
    from types import SimpleNamespace

    from normswap.evaluation.task_schema import check_generation_fits

    def task(**kwargs):
        return SimpleNamespace(task_name="t", config=SimpleNamespace(output_type="generate_until", generation_kwargs=kwargs))

    check_generation_fits([task(max_gen_toks=255), "a-group-name"], 256, 256)
    for tasks in ([task(max_gen_toks=256)], [task()]):
        with pytest.raises(NormswapError, match="leaves no room for a prompt in the model's max length 256"):
            check_generation_fits(tasks, 256, 256)


def test_task_class_that_is_no_code_is_refused_even_when_code_is_trusted(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NORMSWAP_EVALS_DIR", str(_task_folder(tmp_path, lambda text: text + "class: os.system\n")))
    refused(capsys, tmp_path, "eval", "normswap:austen-gpt2", "--tasks", "persuasion_lastword", "--no-perplexity",
            "--limit", "4", "--no-progress", "--trust-remote-code", needle="'class' must be Python code (a !function tag)")


def test_bundled_tasks_pass_the_schema():
    from normswap.evaluation.task_schema import check_task

    for task in sorted((ROOT / "normswap" / "evals").glob("*.yaml")):
        check_task(bounded.read_yaml(task), str(task))


def test_the_reader_accepts_ordinary_files():
    data = bounded.parse_json('{"a": [1, 2.5, {"b": null}], "n": 1000000000000000019884624838656}', "x")
    assert data["n"] == 10**30 + 19884624838656


# ---------------------------------------------------------------------------------------------
# 2. one dtype policy, checked as each weight file's header is read


def _to_bin(src: Path, change) -> None:
    from safetensors.torch import load_file

    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    change(state)
    torch.save(state, src / "pytorch_model.bin")


WTE = "transformer.wte.weight"
BIN_TENSORS = {
    "complex": (lambda state: state.update({WTE: state[WTE].to(torch.complex64)}), "dtype complex64"),
    "sparse": (lambda state: state.update({WTE: state[WTE].to_sparse()}), "sparse_coo layout"),
    "meta": (lambda state: state.update({WTE: torch.empty(50, 16, device="meta")}), "on the meta device"),
    "nested": (lambda state: state.update({WTE: torch.nested.nested_tensor([torch.ones(2, 16), torch.ones(3, 16)])}),
               "nested tensor"),
    "quantised": (lambda state: state.update({WTE: torch.quantize_per_tensor(state[WTE], 0.1, 0, torch.qint8)}),
                  "dtype qint8; quantised"),
    "int64-weight": (lambda state: state.update({WTE: state[WTE].to(torch.int64)}), "dtype int64"),
    "bool-norm": (lambda state: state.update({"transformer.h.0.ln_1.weight": state["transformer.h.0.ln_1.weight"] > 0}),
                  "transformer.h.0.ln_1.weight has dtype bool"),
    "fp8": (lambda state: state.update({WTE: state[WTE].to(torch.float8_e4m3fn)}), "dtype float8_e4m3fn; quantised"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(BIN_TENSORS))
def test_bin_tensor_kinds_refused_at_read(source, tmp_path, capsys, case):
    change, needle = BIN_TENSORS[case]
    src = copy(source, tmp_path)
    _to_bin(src, change)
    line = refused(capsys, tmp_path, "convert", src, "--out", tmp_path / "out", "--verify", "none", needle=needle)
    assert "pytorch_model.bin" in line


def _retype(name: str, dtype: str, scale: float):
    def change(header, data):
        entry = header[name]
        entry["dtype"] = dtype
        entry["shape"] = [int(entry["shape"][0] * scale), *entry["shape"][1:]]
        return header, data
    return change


SAFETENSORS_DTYPES = {
    "I64-weight": (_retype(WTE, "I64", 0.5), "transformer.wte.weight has dtype int64"),
    "I32-weight": (_retype(WTE, "I32", 1), "has dtype int32"),
    "BOOL-norm": (_retype("transformer.h.0.ln_1.bias", "BOOL", 4), "has dtype bool"),
    "U8-weight": (_retype(WTE, "U8", 4), "has dtype uint8"),
    "C64": (_retype(WTE, "C64", 0.5), "has dtype complex64"),
    "F8_E4M3": (_retype("transformer.h.0.ln_1.bias", "F8_E4M3", 4), "float8_e4m3fn; quantised"),
    "F8_E8M0": (_retype("transformer.h.0.ln_1.bias", "F8_E8M0", 4), "float8_e8m0fnu; quantised"),
    "U16": (_retype(WTE, "U16", 2), "has dtype uint16"),
    "F4": (_retype(WTE, "F4", 8), "has dtype F4"),
    "unknown-code": (_retype(WTE, "Q4_K", 1), "has dtype Q4_K"),
    "code-with-punctuation": (_retype(WTE, "F32;", 1), "not a safetensors dtype"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_DTYPES))
def test_safetensors_dtypes_refused_at_read(source, tmp_path, capsys, case):
    change, needle = SAFETENSORS_DTYPES[case]
    src = copy(source, tmp_path)
    rewrite_header(src / "model.safetensors", change)
    refused(capsys, tmp_path, "inspect", src, needle=needle)


@pytest.mark.parametrize("command", ["eval", "geometry"])
def test_dtype_policy_holds_for_every_command(source, tmp_path, capsys, command):
    src = copy(source, tmp_path)
    rewrite_header(src / "model.safetensors", _retype(WTE, "C64", 0.5))
    refused(capsys, tmp_path, command, src, needle="has dtype complex64")


def test_integer_causal_mask_buffers_are_accepted(source, tmp_path, capsys):
    src = copy(source, tmp_path)
    _to_bin(src, lambda state: state.update({"transformer.h.0.attn.bias": torch.ones(1, 1, 16, 16, dtype=torch.bool),
                                             "transformer.h.0.attn.masked_bias": torch.tensor(-1e4)}))
    assert main(["convert", str(src), "--out", str(tmp_path / "out"), "--verify", "none", "--quiet"]) == 0
    assert "transformer.h.0.attn.bias" not in json.loads((tmp_path / "out" / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# 3. tokenizers, processors and generation settings against the model, before any model loads


@pytest.mark.parametrize("command", ["inspect", "convert", "eval", "geometry", "verify"])
def test_tokenizer_beyond_the_vocabulary(source, tmp_path, capsys, command):
    src = with_tokenizer(copy(source, tmp_path))
    args = {"inspect": ["inspect", src], "convert": ["convert", src, "--out", tmp_path / "out"], "eval": ["eval", src],
            "geometry": ["geometry", src], "verify": ["verify", src, source]}[command]
    refused(capsys, tmp_path, *args, needle="token ids up to 2047, but the model's vocabulary holds 50")


def test_added_token_beyond_the_vocabulary(tmp_path, capsys):
    src = copy(EXAMPLE, tmp_path)
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 4096, "content": "<x>", "special": True, "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False})
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused(capsys, tmp_path, "eval", src, needle="token ids up to 4096")


def test_loaded_tokenizer_is_checked_too(source, tmp_path):
    """The same check on the tokenizer transformers builds (for formats not read as JSON)."""
    from normswap.runtime.reference import load_tokenizer

    src = with_tokenizer(copy(source, tmp_path))
    with pytest.raises(NormswapError, match="does not belong to this model"):
        load_tokenizer(src)
    assert load_tokenizer(EXAMPLE) is not None


PROCESSOR_PROBLEMS = {
    "whisper": {
        "sampling_rate-0": ({"sampling_rate": 0}, "'sampling_rate' must be a whole number of Hz"),
        "sampling_rate-negative": ({"sampling_rate": -16000}, "'sampling_rate'"),
        "sampling_rate-string": ({"sampling_rate": "16000"}, "'sampling_rate'"),
        "sampling_rate-huge": ({"sampling_rate": 10**12}, "'sampling_rate'"),
        "feature_size-mismatch": ({"feature_size": 128}, "the model reads 80 mel bins"),
        "hop-longer-than-window": ({"hop_length": 800}, "longer than 'n_fft'"),
        "frames-mismatch": ({"chunk_length": 10}, "makes 1000 frames, but the model reads 3000"),
        "n_fft-zero": ({"n_fft": 0}, "'n_fft' must be a positive integer"),
        "n_fft-huge": ({"n_fft": 2_000_000}, "'n_fft' must be a positive integer of at most 4096"),
        "clip-huge": ({"sampling_rate": 768_000, "chunk_length": 60}, "samples per clip; normswap reads at most"),
        "n_samples-stale": ({"n_samples": 10**9}, "'n_samples' is 1000000000, but 30 s at 16000 Hz"),
        "dither-huge": ({"dither": 1e308}, "'dither' must be a number from 0 to 1"),
        "padding-nan": ({"padding_value": math.nan}, "'padding_value' must be a number from -1 to 1"),
        "extractor-class": ({"feature_extractor_type": "Wav2Vec2FeatureExtractor"}, "its own WhisperFeatureExtractor"),
        "processor-class": ({"processor_class": "Wav2Vec2Processor"}, "its own WhisperProcessor"),
    },
    "vit": {
        "100000x100000": ({"size": {"height": 100000, "width": 100000}}, "asks for 100000-pixel images"),
        "huge-int": ({"size": 100000}, "asks for 100000-pixel images"),
        "wrong-size": ({"size": {"height": 32, "width": 32}}, "makes 32x32 images, but the model reads 16x16"),
        "negative": ({"size": {"height": -16, "width": 16}}, "'size' must be a positive integer"),
        "unknown-side": ({"size": {"depth": 16}}, "'size' must be a positive integer"),
        "std-zero": ({"image_std": [0.5, 0.0, 0.5]}, "'image_std' holds 0"),
        "mean-length": ({"image_mean": [0.5, 0.5]}, "'image_mean' must be a finite number or 3"),
        "mean-nan": ({"image_mean": [0.5, math.nan, 0.5]}, "'image_mean' must be a finite number"),
        "resample-unknown": ({"resample": 99}, "'resample' must be one of Pillow's filters"),
        "rescale-string": ({"rescale_factor": "1/255"}, "'rescale_factor' must be a positive number"),
        "no-resize": ({"do_resize": False}, "'do_resize' false keeps each image's own size"),
        "other-family": ({"image_processor_type": "CLIPImageProcessor"}, "is not an image processor of a vit model"),
        "mean-huge": ({"image_mean": [1e308] * 3}, "'image_mean' must be of magnitude"),
        "std-denormal": ({"image_std": [1e-320] * 3}, "'image_std' must be of magnitude"),
    },
    "clip": {
        "huge-crop": ({"crop_size": {"height": 50000, "width": 50000}}, "'crop_size' asks for 50000-pixel"),
        "huge-shortest-edge": ({"size": {"shortest_edge": 100000}}, "'size' asks for 100000-pixel"),
        "crop-mismatch": ({"crop_size": {"height": 8, "width": 8}}, "makes 8x8 images"),
    },
}
PROCESSOR_CASES = [(family, case) for family, cases in PROCESSOR_PROBLEMS.items() for case in cases]


@pytest.mark.parametrize(("family", "case"), PROCESSOR_CASES)
def test_processor_against_the_model(media, tmp_path, capsys, family, case):
    values, needle = PROCESSOR_PROBLEMS[family][case]
    src = copy(media[family], tmp_path)
    edit_json(src / "preprocessor_config.json", **values)
    line = refused(capsys, tmp_path, "inspect", src, needle=needle)
    assert "preprocessor_config.json" in line


@pytest.mark.parametrize(("family", "option", "values", "needle"), [
    ("whisper", "--audio", {"sampling_rate": 0}, "'sampling_rate'"),
    ("vit", "--images", {"size": {"height": 100000, "width": 100000}}, "100000-pixel"),
])
def test_media_eval_refuses_the_processor_before_loading(media, tmp_path, capsys, family, option, values, needle):
    src = copy(media[family], tmp_path)
    edit_json(src / "preprocessor_config.json", **values)
    refused(capsys, tmp_path, "eval", src, option, "bundled", needle=needle)


GENERATION_PROBLEMS = {
    "contrastive-search": ({"penalty_alpha": 0.6, "top_k": 4}, "'penalty_alpha' = 0.6 selects a decoding strategy"),
    "dola": ({"dola_layers": "high"}, "'dola_layers'"),
    "group-beam-search": ({"num_beams": 4, "num_beam_groups": 2}, "'num_beam_groups'"),
    "constrained-beam-search": ({"force_words_ids": [[1]]}, "'force_words_ids'"),
    "custom-generate": ({"custom_generate": "someone/decoding"}, "'custom_generate'"),
    "prompt-lookup": ({"prompt_lookup_num_tokens": 3}, "'prompt_lookup_num_tokens'"),
    "decoder-start-beyond-vocabulary": ({"decoder_start_token_id": 10**6}, "'decoder_start_token_id' must be a token id"),
    "eos-list-with-string": ({"eos_token_id": [256, "x"]}, "'eos_token_id' must be a token id"),
    "suppress-string": ({"suppress_tokens": "all"}, "'suppress_tokens' must be a list"),
    "forced-ids-malformed": ({"forced_decoder_ids": [[1]]}, "'forced_decoder_ids'"),
    "max_new_tokens-negative": ({"max_new_tokens": -1}, "'max_new_tokens' must be a positive integer"),
}


@pytest.mark.parametrize("case", list(GENERATION_PROBLEMS))
def test_generation_config_settings(media, tmp_path, capsys, case):
    values, needle = GENERATION_PROBLEMS[case]
    src = copy(media["whisper"], tmp_path)
    edit_json(src / "generation_config.json", **values)
    refused(capsys, tmp_path, "inspect", src, needle=needle)


def test_whisper_eval_refuses_a_hub_decoding_strategy(media, tmp_path, capsys):
    src = copy(media["whisper"], tmp_path)
    edit_json(src / "generation_config.json", penalty_alpha=0.6, top_k=4)
    refused(capsys, tmp_path, "eval", src, "--audio", "bundled", needle="fetches no decoding code")


# ---------------------------------------------------------------------------------------------
# 7. config keys that steer the libraries, and other inputs of the same pass

STEERING = {
    "attn-hub-kernel": ({"attn_implementation": "kernels-community/flash-attn"}, "'attn_implementation' = 'kernels-co"),
    "attn-flash2": ({"attn_implementation": "flash_attention_2"}, "eager or sdpa"),
    "attn-unknown": ({"attn_implementation": "bogus"}, "eager or sdpa"),
    "attn-number": ({"attn_implementation": 3}, "eager or sdpa"),
    "attn-private-key": ({"_attn_implementation": "kernels-community/x"}, "'_attn_implementation'"),
    "attn-dict": ({"attn_implementation": {"": "sdpa", "text_config": "kernels-community/x"}}, "eager or sdpa"),
    "attn-sub-config": ({"text_config": {"attn_implementation": "kernels-community/x"}}, "'text_config.attn_implementation'"),
    "experts-kernel": ({"experts_implementation": "kernels-community/moe"}, "'experts_implementation'"),
    "gptq": ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantised ('gptq')"),
    "bitsandbytes": ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
                     "quantised ('bitsandbytes')"),
    "quantization-malformed": ({"quantization_config": {"bits": 4}}, "says the checkpoint is quantised"),
    "quantization-garbage": ({"quantization_config": "garbage"}, "says the checkpoint is quantised"),
    "dtype-int8": ({"dtype": "int8"}, "'dtype' = 'int8' is not a floating dtype"),
    "torch_dtype-number": ({"torch_dtype": 5}, "'torch_dtype' = 5"),
    "return_dict-false": ({"return_dict": False}, "'return_dict' = False makes the model return plain tuples"),
    "torchscript": ({"torchscript": True}, "'torchscript' = True makes the model return plain tuples"),
}


@pytest.mark.parametrize("case", list(STEERING))
def test_steering_config_keys(source, tmp_path, capsys, case):
    values, needle = STEERING[case]
    src = copy(source, tmp_path)
    edit_json(src / "config.json", **values)
    refused(capsys, tmp_path, "convert", src, "--out", tmp_path / "out", needle=needle)


@pytest.mark.parametrize("command", ["inspect", "eval", "geometry", "verify"])
def test_steering_keys_refused_by_every_command(source, tmp_path, capsys, command):
    src = copy(source, tmp_path)
    edit_json(src / "config.json", attn_implementation="kernels-community/flash-attn")
    args = {"inspect": ["inspect", src], "eval": ["eval", src], "geometry": ["geometry", src],
            "verify": ["verify", src, source]}[command]
    refused(capsys, tmp_path, *args, needle="loads no kernel a config names")


def test_config_transformers_rejects_is_one_line(tmp_path, capsys):
    src = copy(EXAMPLE, tmp_path)
    edit_json(src / "config.json", output_attentions=True, attn_implementation="sdpa")
    refused(capsys, tmp_path, "eval", src, "--no-progress", needle="config.json: transformers rejects it")


def test_weights_of_another_shape_than_the_config_needs(media, tmp_path, capsys):
    src = copy(media["vit"], tmp_path)
    edit_json(src / "config.json", id2label={str(i): str(i) for i in range(5)})
    refused(capsys, tmp_path, "eval", src, "--images", "bundled", needle="tensor classifier.bias has shape [3], but the model that config.json describes needs [5]")


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("command", ["eval", "geometry"])
def test_non_finite_weights_refused_by_eval_and_geometry(source, tmp_path, capsys, command, value):
    from safetensors.torch import load_file, save_file

    src = copy(source, tmp_path)
    state = load_file(src / "model.safetensors")
    state["transformer.h.1.mlp.c_fc.weight"][0, 0] = value
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    args = ["eval", src, "--no-progress"] if command == "eval" else ["geometry", src, "--random-tokens"]
    refused(capsys, tmp_path, *args, needle="weight transformer.h.1.mlp.c_fc.weight holds NaN or infinite")


@pytest.mark.parametrize("content", [b"\0" * 20000, b"Some text.\n\0\0 more\n"], ids=["all-nul", "some-nul"])
@pytest.mark.parametrize("command", ["eval", "geometry", "rotate"])
def test_text_with_nul_bytes(source, tmp_path, capsys, command, content):
    text = tmp_path / "text.txt"
    text.write_bytes(content)
    args = {"eval": ["eval", "normswap:austen-gpt2", "--text", text, "--no-progress"],
            "geometry": ["geometry", "normswap:austen-gpt2", "--text", text],
            "rotate": ["rotate", "normswap:austen-gpt2", "--out", tmp_path / "out", "--method", "pca",
                       "--calibration", text]}[command]
    refused(capsys, tmp_path, *args, needle="is not text: it holds NUL bytes")


@pytest.mark.parametrize("limit", ["1e300", "1e10", "inf", "nan", "0", "-3"])
def test_eval_limit(tmp_path, capsys, limit):
    needle = "more documents than any task holds" if limit in ("1e300", "1e10") else "must be a positive number"
    refused(capsys, tmp_path, "eval", "normswap:austen-gpt2", "--tasks", "local", "--limit", limit, needle=needle)


@pytest.mark.parametrize(("option", "value"), [("--max-tokens", "1" + "0" * 23), ("--seed", "1" + "0" * 23),
                                               ("--seed", "-1"), ("--max-tokens", "0")])
def test_geometry_numbers_beyond_what_torch_holds(tmp_path, capsys, option, value):
    with pytest.raises(SystemExit) as exit_:
        main(["geometry", "normswap:austen-gpt2", "--random-tokens", option, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and f"argument {option}: must be at" in err


def test_hopeless_perplexity_is_inf_not_an_overflow():
    from normswap.evaluation.perplexity import exp_or_inf

    assert exp_or_inf(1e6) == math.inf and exp_or_inf(0.0) == 1.0


# ---------------------------------------------------------------------------------------------
# 8. checkpoints with no usable weights, refused before anything is written


def _no_floating(header, data):
    return {"__metadata__": {"format": "pt"}}, b""


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", ["empty-header", "metadata-only", "empty-bin", "only-integer-buffers"])
@pytest.mark.parametrize("command", ["convert", "eval"])
def test_no_weights(source, tmp_path, capsys, case, command):
    src = copy(source, tmp_path)
    if case == "empty-header":
        rewrite_header(src / "model.safetensors", lambda header, data: ({}, b""))
    elif case == "metadata-only":
        rewrite_header(src / "model.safetensors", _no_floating)
    elif case == "empty-bin":
        _to_bin(src, lambda state: state.clear())
    else:
        _to_bin(src, lambda state: (state.clear(), state.update({"transformer.h.0.attn.bias": torch.ones(1, dtype=torch.bool)})))
    args = ["convert", src, "--out", tmp_path / "out", "--verify", "none"] if command == "convert" else ["eval", src]
    refused(capsys, tmp_path, *args, needle="has no weights")


@pytest.mark.parametrize(("removed", "untie"), [("transformer.h.1.mlp.c_fc.weight", False), ("transformer.ln_f.bias", False),
                                                ("lm_head.weight", True)])
@pytest.mark.parametrize("command", ["convert", "eval"])
def test_weights_the_config_needs(source, tmp_path, capsys, command, removed, untie):
    from safetensors.torch import load_file, save_file

    src = copy(source, tmp_path)
    state = load_file(src / "model.safetensors")
    state.pop(removed, None)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    if untie:
        edit_json(src / "config.json", tie_word_embeddings=False)
    args = (["convert", src, "--out", tmp_path / "out", "--verify", "none"] if command == "convert"
            else ["eval", src, "--no-progress"])
    line = refused(capsys, tmp_path, *args, needle=removed)
    assert "random" in line


# ---------------------------------------------------------------------------------------------
# 9. the last line of defence


def test_unexpected_error_is_one_line_with_its_traceback_saved(source, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug\nspanning lines")

    monkeypatch.setattr("normswap.convert.install.write_weights", broken)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "traces"))
    (tmp_path / "traces").mkdir()
    out = tmp_path / "out"
    code = main(["convert", str(source), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == cli.INTERNAL_EXIT == 70 and len(lines) == 1, err
    assert lines[0].startswith("normswap convert: internal error: RuntimeError: a bug spanning lines"), lines[0]
    [trace] = list((tmp_path / "traces").iterdir())
    assert str(trace) in lines[0] and "Traceback" in trace.read_text() and "a bug" in trace.read_text()
    assert not out.exists() and sorted(path.name for path in tmp_path.iterdir()) == ["traces"]


def _png(path: Path, side: int) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (side, side), 7).save(path)
    return path


def test_image_pixels_bounded_from_the_header_and_only_what_is_needed_is_read(tmp_path, monkeypatch):
    """An image over the pixel bound is refused before it is decoded; Pillow's bomb warning is the
    same one-line refusal; a limit reads no image past it."""
    from PIL import Image

    from normswap.evaluation import media

    _png(tmp_path / "set" / "a.png", 8)
    _png(tmp_path / "set" / "b.png", 20)
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    assert len(media.read_images(str(tmp_path / "set"), limit=1).images) == 1
    with pytest.raises(NormswapError, match="b.png is 20x20 pixels, over the 100"):
        media.read_images(str(tmp_path / "set"))
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 10**6)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)  # warns above 300 pixels, fails above 600
    with pytest.raises(NormswapError, match="cannot read image file .*b.png"):
        media.read_images(str(tmp_path / "set"))


def test_calibration_text_is_read_as_a_bounded_prefix(tmp_path):
    from normswap.rotate.calibration import CHARS_PER_TOKEN, read_calibration

    (tmp_path / "big.txt").write_text("word " * 10000)
    assert len(read_calibration(tmp_path / "big.txt", 10)) == 10 * CHARS_PER_TOKEN


def test_positions_per_image_count_every_token_before_the_patches(tmp_path):
    """DeiT runs a class and a distillation token before its patches; ViT one class token."""
    import transformers as T
    from helpers import save

    from normswap.evaluation.calibration import positions_per_image

    shape = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, image_size=16,
                 patch_size=8)
    for name, model, extra in (("deit", T.DeiTModel(T.DeiTConfig(**shape)), 2), ("vit", T.ViTModel(T.ViTConfig(**shape)), 1)):
        path = save(model, tmp_path / name)
        assert positions_per_image(path, json.loads((path / "config.json").read_text())) == 4 + extra


def test_pixel_values_that_overflow_are_refused_before_calibration(media, tmp_path, capsys):
    src = copy(media["vit"], tmp_path)
    edit_json(src / "preprocessor_config.json", rescale_factor=1e300)
    refused(capsys, tmp_path, "rotate", src, "--out", tmp_path / "out", "--method", "pca", "--calibration", "bundled",
            needle="non-finite pixel values")
