"""lm-eval integration: local task folders, task resolution, and runs on already-loaded models.

Models are handed to lm-eval as objects (``HFLM(pretrained=model, tokenizer=tokenizer)``) so both
models of a comparison are evaluated exactly as loaded, with the same batch size and max length.
Under ``accelerate launch`` with several processes lm-eval must load the model itself to shard the
data, so there ``HFLM`` gets the checkpoint path instead (see README.md beside this file).

Local tasks live in ``normswap/evals/`` (``local_tasks.py`` makes them runnable).
"""

from __future__ import annotations

import functools
import logging
import math
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from normswap.errors import NormswapError, first_line, quoted, quoted_list
from normswap.evaluation.hub import hub_reachable
from normswap.evaluation.local_tasks import (  # noqa: F401  (re-exported: the task folder's names)
    BUNDLED_EVALS,
    LOCAL_ALIAS,
    TEXT_TASK,
    evals_dir,
    local_tasks,
    materialise_tasks,
)
from normswap.evaluation.task_code import sandboxed_templates
from normswap.evaluation.task_schema import check_generation_fits
from normswap.extras import require

# Standard lm-eval tasks the recipes use; anything else is looked up in lm-eval's full index.
KNOWN_HUB_TASKS = {"wikitext", "lambada_openai", "lambada_standard", "hellaswag", "piqa", "arc_easy",
                   "arc_challenge", "winogrande", "openbookqa", "boolq", "sciq"}




@dataclass
class TaskPlan:
    """Which requested tasks are local (run from scratch YAMLs) and which come from lm-eval itself."""

    local: list[str]
    hub: list[str]

    @property
    def all(self) -> list[str]:
        return self.local + self.hub


def plan_tasks(requested: list[str], *, with_text_task: bool = False) -> TaskPlan:
    """Split task names into local and standard ones; expand ``local``; reject unknown names early.

    Names that are neither local nor common standard tasks are checked against lm-eval's own index
    (online only; indexing every lm-eval task costs about 14 s).
    """
    local_names = set(local_tasks()) if requested else set()
    local: list[str] = []
    hub: list[str] = []
    for name in dict.fromkeys(requested):  # each name once, in order (a set keeps the check linear)
        if name == LOCAL_ALIAS:
            local.extend(sorted(n for n in local_names if n not in local))
        elif name in local_names or name == TEXT_TASK:
            if name not in local:
                local.append(name)
        else:
            hub.append(name)
    if with_text_task and TEXT_TASK not in local:
        local.append(TEXT_TASK)
    unknown = [name for name in hub if name not in KNOWN_HUB_TASKS]
    if unknown:
        known_local = ", ".join(sorted(local_names)) or "none"
        if not hub_reachable():
            # Offline, a name that is not local cannot run whatever it is: say both things at once.
            raise NormswapError(
                f"unknown task(s) {quoted_list(unknown)}: not in normswap/evals/ (local tasks: {known_local}, or "
                f"'{LOCAL_ALIAS}'), and standard lm-eval tasks need the Hugging Face hub, which is unreachable"
            )
        from lm_eval.tasks import TaskManager

        index = set(TaskManager().all_tasks)
        missing = [name for name in unknown if name not in index]
        if missing:
            raise NormswapError(
                f"unknown lm-eval task(s): {quoted_list(missing)}; local tasks are {known_local} "
                f"(or '{LOCAL_ALIAS}' for all of them)"
            )
    return TaskPlan(local=local, hub=hub)


@dataclass
class TaskResults:
    """Aggregate metrics and per-document values of one lm-eval run of one model."""

    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # task -> metric -> value
    stderr: dict[str, dict[str, float]] = field(default_factory=dict)
    # task -> doc_id -> loglikelihoods (one per request: the document, the target, or each choice)
    per_doc: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    n_docs: dict[str, int] = field(default_factory=dict)


def _doc_loglikelihoods(sample: dict[str, Any]) -> list[float]:
    """The loglikelihood(s) lm-eval computed for one logged sample, whatever the output type."""
    values: list[float] = []
    for response in sample.get("filtered_resps") or sample.get("resps") or []:
        while isinstance(response, (list, tuple)) and response:
            response = response[0]  # (loglikelihood, is_greedy) or [[...]] nestings
        if isinstance(response, (int, float)) and not isinstance(response, bool):
            values.append(float(response))
    return values


def parse_results(raw: dict[str, Any]) -> TaskResults:
    """Turn ``simple_evaluate``'s dict into ``TaskResults`` (metric names without the ``,none`` filter)."""
    out = TaskResults()
    for task, entries in raw.get("results", {}).items():
        for key, value in entries.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or "," not in key:
                continue
            metric, _filter = key.split(",", 1)
            if metric.endswith("_stderr"):
                if isinstance(value, float) and math.isfinite(value):
                    out.stderr.setdefault(task, {})[metric[: -len("_stderr")]] = float(value)
            else:
                out.metrics.setdefault(task, {})[metric] = float(value)
    for task, samples in (raw.get("samples") or {}).items():
        out.per_doc[task] = {int(s["doc_id"]): _doc_loglikelihoods(s) for s in samples}
        out.n_docs[task] = len(samples)
    return out


def make_lm(model, tokenizer, *, batch_size: int, max_length: int | None, share_contexts: bool = True,
            encodings: dict[str, dict] | None = None, progress: bool = True):
    """Wrap a loaded model for lm-eval, quietly: ``SharedContextHFLM`` (HFLM scoring a shared context
    once), or with ``share_contexts=False`` lm-eval's own ``HFLM``, unchanged.

    ``encodings`` (tokenizer fingerprint -> memo of encoded strings), kept across the models of a
    comparison, lets a model whose tokenizer encodes exactly as an earlier one's reuse its encodings.
    """

    require("eval", "lm-eval tasks")
    from lm_eval.models.huggingface import HFLM

    from normswap.evaluation.shared_context import SharedContextHFLM

    # HFLM warns that a model object ignores its loading arguments; that is the point here.
    logging.getLogger("lm_eval.models.huggingface").setLevel(logging.ERROR)
    if not share_contexts:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    else:
        lm = SharedContextHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        fingerprint = lm.tokenizer_fingerprint() if encodings is not None else None
        if fingerprint is not None:
            lm.encodings = encodings.setdefault(fingerprint, lm.encodings)
    if not progress:
        _without_request_bars(lm)
    return lm


def bars_off_by_default() -> None:
    """Turn off, in this process, every bar that does not ask to be drawn: lm-eval's request
    building passes no ``disable=``. ``TQDM_DISABLE`` cannot do it once tqdm is imported, since
    tqdm reads it then (a forked copy of a process that imported it)."""
    from tqdm import std

    std.tqdm.__init__ = functools.partialmethod(std.tqdm.__init__, disable=True)


def _without_request_bars(lm) -> None:
    """Turn off the model's request bars. They pass ``disable=`` explicitly, so ``TQDM_DISABLE``
    cannot reach them, and the rolling scorer asks ``_loglikelihood_tokens`` for a bar with an
    explicit ``disable_tqdm=False``: every entry point is wrapped to force ``disable_tqdm=True``."""

    def forced(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            kwargs["disable_tqdm"] = True
            return method(*args, **kwargs)
        return call

    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until", "_loglikelihood_tokens"):
        setattr(lm, name, forced(getattr(lm, name)))


def make_task_manager(plan: TaskPlan, include_dir: Path | None):
    """A TaskManager that indexes only our scratch folder when every task is local (fast)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=bool(plan.hub), include_path=str(include_dir) if include_dir else None)


def _data_error(error: Exception) -> NormswapError:
    return NormswapError(
        f"lm-eval could not load a task's data ({type(error).__name__}: {str(error).splitlines()[0][:160]}); "
        "standard tasks need the Hugging Face hub"
    )


def load_tasks(task_manager, names: list[str], *, sandboxed: bool = False) -> list:
    """lm-eval ``Task`` objects for ``names`` (data read, documents prepared), to pass to every run
    in place of the names; the names themselves when they include groups, which lm-eval
    aggregates only when it loads them itself. ``sandboxed`` as for ``run_tasks``."""

    try:
        with sandboxed_templates(sandboxed), _templates_compiled_once(), _template_errors():
            loaded = task_manager.load(list(names))
    except (ConnectionError, OSError) as error:
        raise _data_error(error) from None
    if loaded.get("groups"):
        return list(names)
    return list(loaded["tasks"].values())


# environment -> template text -> the template compiled in it, for ``_templates_compiled_once``
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILED_PER_ENVIRONMENT = 1024


@contextmanager
def _templates_compiled_once() -> Iterator[None]:
    """lm-eval renders a task's templates with ``utils.apply_template``, which compiles the
    template text again for every document (``env.from_string``: 1.5 s of the bundled pair's
    eval). In this block each text is compiled once per environment (lm-eval's own, or the
    sandbox of ``sandboxed_templates``, whose checks run as the compiled template renders) and
    rendered the same way."""
    from lm_eval import utils

    original = utils.apply_template

    def apply_template(template: str, doc: dict) -> str:
        environment = utils.env
        compiled = _COMPILED.setdefault(environment, {})
        if template not in compiled:
            if len(compiled) >= _COMPILED_PER_ENVIRONMENT:
                compiled.clear()
            compiled[template] = environment.from_string(template)
        return compiled[template].render(**doc)

    utils.apply_template = apply_template
    try:
        yield
    finally:
        utils.apply_template = original


@contextmanager
def _template_errors() -> Iterator[None]:
    """A template the sandbox stopped, as one line."""
    from jinja2.exceptions import SecurityError

    try:
        yield
    except SecurityError as error:
        raise NormswapError(f"a task template reaches Python internals ({first_line(error)}); a task folder is "
                            "code, and code from one outside normswap runs only with --trust-remote-code") from None


@contextmanager
def _no_git_probe() -> Iterator[None]:
    """lm-eval runs ``git describe`` in the current folder to record a commit hash, and git prints
    ``fatal: not a git repository`` to the terminal outside one. The hash describes lm-eval's
    caller, not the models; the report does not use it, so it is not asked for."""
    from lm_eval import evaluator

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:
        yield
        return
    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


@contextmanager
def _versions_only_env_info() -> Iterator[None]:
    """Make lm-eval's environment record cheap for the duration of a run.

    ``simple_evaluate`` ends with ``add_env_info``, which calls torch's ``collect_env``: eleven
    subprocesses (pip, conda, nvidia-smi, ...) per run, seconds on a small CPU machine, for a
    block of text normswap does not report. Versions are recorded instead.
    """
    import lm_eval.evaluator as evaluator

    original = getattr(evaluator, "add_env_info", None)
    if original is None:  # another lm-eval layout: leave it alone
        yield
        return

    def add_versions(storage: dict[str, Any]) -> None:

        storage["pretty_env_info"] = "not collected (normswap records versions only)"
        for key, distribution in (("lm_eval_version", "lm_eval"), ("transformers_version", "transformers")):
            try:
                storage[key] = version(distribution)
            except Exception:  # a distribution without metadata
                storage[key] = "unknown"

    evaluator.add_env_info = add_versions
    try:
        yield
    finally:
        evaluator.add_env_info = original


MAX_LIMIT = 10**9  # documents per task: more than any task holds, and within lm-eval's islice


def task_limit(value: float | None, what: str) -> int | float | None:
    """lm-eval's ``limit`` for ``value`` (``what`` names the option): a fraction of each task below
    1, a count of documents from 1 up; anything else is one line."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise NormswapError(f"{what} must be a positive number (a count, or a fraction below 1), not {value!r:.40}")
    if value >= 1 and value != int(value):
        raise NormswapError(f"{what} {value:g} is neither a whole count nor a fraction below 1")
    if value > MAX_LIMIT:
        raise NormswapError(f"{what} {value:g} is more documents than any task holds; "
                            f"give at most {MAX_LIMIT:g}, or leave it out to use every document")
    return int(value) if value >= 1 else value


def run_tasks(lm, task_manager, tasks: list, *, limit: int | float | None = None,
              sandboxed: bool = False) -> TaskResults:
    """Run ``tasks`` (names, or ``Task`` objects from ``load_tasks``) on an HFLM with lm-eval's
    Python API, logging samples for per-document deltas; ``sandboxed``: templates are rendered
    in Jinja's sandbox (``task_code``)."""
    import lm_eval

    from normswap.runtime.reference import transformers_errors_only

    for name in ("lm_eval", "lm_eval.api.task", "lm_eval.evaluator"):
        logging.getLogger(name).setLevel(logging.WARNING)
    check_fraction(limit, tasks)
    check_generation_fits(tasks, lm.max_length, lm.max_gen_toks)
    try:
        with (_no_git_probe(), _versions_only_env_info(), transformers_errors_only(), sandboxed_templates(sandboxed),
              _templates_compiled_once(), _template_errors()):
            raw = lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                task_manager=task_manager,
                limit=limit,
                log_samples=True,
                bootstrap_iters=0,  # stderr by bootstrap is slow and not needed for the comparison
            )
    except (ConnectionError, OSError) as error:
        raise _data_error(error) from None
    except AssertionError as error:
        if not _continuation_too_long(error):
            raise
        raise NormswapError(f"lm-eval cannot score these tasks with max length {lm.max_length}: a continuation is "
                            "longer than the model's window; pass a larger --max-length") from None
    if raw is None:  # non-zero ranks under accelerate launch get nothing back
        return TaskResults()
    return parse_results(raw)


def check_fraction(limit: int | float | None, tasks: list) -> None:
    """Refuse a fractional ``limit`` that stands for less than one document of a loaded task
    (lm-eval would round it up to one, which a count says plainly)."""
    if limit is None or limit >= 1:
        return
    for task in tasks:
        docs = getattr(task, "eval_docs", None)
        if docs is not None and len(docs) * limit < 1:
            name = getattr(task, "task_name", "")
            raise NormswapError(f"--limit {limit:g} is less than one of the {len(docs)} documents of task "
                                f"{quoted(str(name))}; pass a count (--limit 1) or a fraction of at least "
                                f"1/{len(docs)}")


def _continuation_too_long(error: AssertionError) -> bool:
    """Whether ``error`` is lm-eval's bare assert that a continuation fits the window (and not
    some other assertion, which stays a bug with its traceback)."""

    frames = traceback.extract_tb(error.__traceback__)
    line = (frames[-1].line or "") if frames else ""
    return "continuation" in line and "max_length" in line
