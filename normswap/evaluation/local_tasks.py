"""The task YAMLs shipped in ``normswap/evals/``, made runnable.

Local tasks are ordinary lm-eval YAMLs whose ``data_files`` are relative to the YAML. lm-eval
resolves relative paths against the working directory, so before each run the YAMLs are copied
into a scratch folder with ``data_files`` rewritten to absolute paths; the ``--text`` documents
become one more task there, scored by rolling loglikelihood.

A task folder is code (``task_code``): the bundled ``normswap/evals/`` is trusted; one named by
``NORMSWAP_EVALS_DIR`` runs its ``!function``, ``include:`` and ``class:`` only with
``--trust-remote-code`` (then lm-eval reads the original YAML, through an ``include:`` of it, so
its code resolves beside it), and is refused, naming what it holds, without.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from normswap.checkpoint.bounded import read_yaml
from normswap.errors import NormswapError
from normswap.evaluation.task_code import TaskLoader, code_in
from normswap.evaluation.task_schema import check_task
from normswap.evaluation.text import TextSource

# The task generated at run time over the --text documents (rolling loglikelihood).
TEXT_TASK = "normswap_text"
# Shorthand for all tasks shipped in normswap/evals/.
LOCAL_ALIAS = "local"

BUNDLED_EVALS = Path(__file__).resolve().parents[1] / "evals"  # package data, in a wheel too


def evals_dir() -> Path:
    """The local task folder: ``$NORMSWAP_EVALS_DIR``, else the package's own ``normswap/evals/``."""
    override = os.environ.get("NORMSWAP_EVALS_DIR")
    path = Path(override) if override else BUNDLED_EVALS
    if not path.is_dir():
        raise NormswapError(f"local task folder {path} not found; set NORMSWAP_EVALS_DIR to a folder of task YAMLs")
    return path


def _read_yaml(path: Path) -> dict[str, Any]:
    data = read_yaml(path, what=f"task file {path}", mapping=False, loader=TaskLoader)  # tags stay data
    if not isinstance(data, dict):
        raise NormswapError(f"task file {path} does not describe an lm-eval task")
    return data


def local_tasks(folder: Path | None = None) -> dict[str, Path]:
    """Task name -> YAML file for every task YAML directly inside ``folder`` (default ``normswap/evals/``)."""
    folder = folder or evals_dir()
    tasks: dict[str, Path] = {}
    for path in sorted(folder.glob("*.yaml")):
        name = _read_yaml(path).get("task")
        if isinstance(name, str):
            tasks[name] = path
    return tasks


def _absolutise_data_files(config: dict[str, Any], base: Path) -> dict[str, Any]:
    """Rewrite ``dataset_kwargs.data_files`` entries relative to ``base`` into absolute paths."""
    kwargs = config.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if files is None:
        return config

    def fix(entry: Any) -> Any:
        if isinstance(entry, list):
            return [fix(item) for item in entry]
        path = Path(str(entry))
        path = path if path.is_absolute() else (base / path).resolve()
        if not path.exists():
            raise NormswapError(f"data file {path} of task {config.get('task')} does not exist")
        return str(path)

    kwargs["data_files"] = {split: fix(entry) for split, entry in files.items()} if isinstance(files, dict) else fix(files)
    config["dataset_kwargs"] = kwargs
    return config


def _runnable(source: Path, trust_remote_code: bool) -> dict[str, Any]:
    """The YAML to run for the local task file ``source`` (see the module docstring)."""
    config = _read_yaml(source)
    trusted = source.resolve().parent == BUNDLED_EVALS.resolve()
    found = code_in(config)
    if found is not None and not (trusted or trust_remote_code):
        raise NormswapError(f"task file {source} holds {found}: a task folder is code, and code from one outside "
                            "normswap runs only with --trust-remote-code")
    check_task(config, f"task file {source}")  # before lm-eval builds anything from it
    if found is None:
        return _absolutise_data_files(config, source.parent)
    kwargs = config.get("dataset_kwargs")
    plain = {key: value for key, value in config.items() if key in ("task", "dataset_kwargs")}
    runnable = _absolutise_data_files(plain, source.parent) if isinstance(kwargs, dict) else plain
    return {"include": str(source.resolve()), **runnable}


def materialise_tasks(workdir: Path, names: list[str], text: TextSource | None = None, *,
                      trust_remote_code: bool = False) -> Path:
    """Write runnable YAMLs for the local tasks in ``names`` (and the text task) into ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    available = local_tasks() if any(name != TEXT_TASK for name in names) else {}
    for name in names:
        if name == TEXT_TASK:
            continue
        source = available[name]
        config = _runnable(source, trust_remote_code)
        (workdir / source.name).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    if TEXT_TASK in names:
        if text is None:
            raise NormswapError(f"task {TEXT_TASK} needs a text source")
        data = workdir / f"{TEXT_TASK}.jsonl"
        with data.open("w", encoding="utf-8") as handle:
            for document in text.documents:
                handle.write(json.dumps({"text": document}, ensure_ascii=False) + "\n")
        config = {
            "task": TEXT_TASK,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": m, "aggregation": agg, "higher_is_better": False}
                for m, agg in (("word_perplexity", "weighted_perplexity"),
                               ("byte_perplexity", "weighted_perplexity"),
                               ("bits_per_byte", "bits_per_byte"))
            ],
            "metadata": {"version": 1.0, "source": text.name},
        }
        (workdir / f"{TEXT_TASK}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return workdir
