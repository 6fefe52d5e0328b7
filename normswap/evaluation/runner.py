"""Evaluate one or more models under identical settings: strided perplexity plus lm-eval tasks.

Every model of a run shares one text source, one tokenised-text length limit (``max_length``), one
batch size, one dtype and one lm-eval task manager, so the only difference between an original
and its converted checkpoint is the checkpoint.

On a CPU with two or three idle cores, the two models of a comparison are scored side by side
(``Evaluator.evaluate_pair``): the baseline in a forked copy of this process on one core, the
model here on the others. A small model's forward passes use a second core poorly (the bundled
model's scoring took 14.5 s on one thread and 10.5 s on two), so one model per core finishes
both sooner. The copy cannot start a thread pool of its own (one the parent started does not
survive the fork), so with more idle cores, where one model gets the pool's whole speed-up, the
models take turns.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from normswap.arguments import check_device_map, check_fields
from normswap.checkpoint.source import resolve_source
from normswap.dtypes import parse_dtype
from normswap.errors import NormswapError
from normswap.evaluation import lmeval
from normswap.evaluation.hub import require_hub
from normswap.evaluation.perplexity import model_max_length, strided_perplexity
from normswap.evaluation.text import TextSource, load_text
from normswap.memory import available_memory
from normswap.runtime import background
from normswap.runtime.reference import tokenize_text
from normswap.threads import cpu_threads, default_threads, pinned_threads

STRIDED_TASK = "strided"


@dataclass
class EvalSettings:
    """Everything that must be identical across the models of one comparison."""

    dtype: str = "float32"
    batch_size: int = 8
    max_length: int | None = None  # None: the first model's context length, then fixed for all
    stride: int | None = None  # None: equal to max_length (non-overlapping windows)
    text: str | None = None  # None: the bundled held-out text
    perplexity: bool = True
    tasks: list[str] = field(default_factory=list)
    limit: int | float | None = None  # per lm-eval task; for quick checks only
    device: str | None = None  # None: cuda when available, else cpu
    device_map: str | None = None  # "auto" spreads a big model over the visible GPUs
    trust_remote_code: bool = False
    progress: bool = True
    audio: str | None = None  # speech models: folder or manifest of transcribed audio (evaluation/media.py)
    images: str | None = None  # vision models: folder of images, class subfolders as labels
    threads: int | None = None  # CPU intra-op threads; None: the idle cores (normswap.threads)
    share_contexts: bool = True  # False: lm-eval's plain HFLM path (see evaluation/shared_context.py)
    side_by_side: bool = True  # False: the models of a comparison one at a time (see Evaluator.evaluate_pair)

    def __post_init__(self) -> None:
        """Every field checked when the settings are made, not deep inside a run."""

        if isinstance(self.tasks, str):
            raise TypeError(f"EvalSettings: tasks must be a list of task names, not the string {self.tasks!r:.40} "
                            f"(pass [{self.tasks!r:.40}])")
        check_fields(self)
        parse_dtype(self.dtype)
        check_device_map("EvalSettings", self.device_map)
        for name in ("batch_size", "max_length", "stride", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise NormswapError(f"EvalSettings: {name} must be at least 1, not {value}")
        if self.limit is not None and not (0 < self.limit < float("inf")) or (
                self.limit is not None and self.limit >= 1 and self.limit != int(self.limit)):
            raise NormswapError(f"EvalSettings: limit must be a positive count or a fraction below 1, not {self.limit}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ModelEval:
    """Scores of one model: flat ``task/metric`` values and per-document loglikelihoods."""

    label: str
    source: str
    metrics: dict[str, float] = field(default_factory=dict)
    per_doc: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """Plain JSON (document numbers as strings), which ``from_json`` reads back exactly."""
        return {**asdict(self), "per_doc": {task: {str(doc): values for doc, values in documents.items()}
                                            for task, documents in self.per_doc.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelEval:
        per_doc = {task: {int(doc): values for doc, values in documents.items()}
                   for task, documents in data["per_doc"].items()}
        return cls(**{**data, "per_doc": per_doc})


def release_memory() -> None:
    """Return a model's memory once the caller has dropped it: collect cycles, empty CUDA's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def data_parallel_world() -> int:
    """Number of processes when started by ``accelerate launch`` / torchrun, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_for_eval(source: str, settings: EvalSettings):
    """Load ``source`` (original or converted checkpoint) with ``normswap.load_model``.

    Converted checkpoints come back in RMSNorm form, which is what the comparison is about. With
    ``device_map`` the model is placed by accelerate over the visible GPUs instead of moved whole.
    """
    from normswap import load_model

    dtype = parse_dtype(settings.dtype)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": settings.trust_remote_code}
    if settings.device_map:
        kwargs["device_map"] = settings.device_map
    model, tokenizer = load_model(source, **kwargs)
    if tokenizer is None:
        raise NormswapError(f"{source} has no tokenizer files; evaluation needs one")
    if not settings.device_map:
        model = model.to(settings.device or _default_device())
    model.eval()
    # Scoring never decodes step by step: a key/value cache would only be built and thrown away
    # (generation reads its own setting from the generation config).
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    return model, tokenizer


class Evaluator:
    """Runs the same evaluation on each model; build once, call ``evaluate`` per model."""

    def __init__(self, settings: EvalSettings, workdir: Path | None = None) -> None:
        self.settings = settings
        if settings.stride is not None and (
            settings.stride < 1 or (settings.max_length is not None and settings.stride > settings.max_length)
        ):
            raise NormswapError(f"--stride must be between 1 and --max-length (got {settings.stride})")
        if settings.max_length is not None and settings.max_length < 2:
            raise NormswapError(f"--max-length must be at least 2 (got {settings.max_length})")
        self.text: TextSource | None = load_text(settings.text) if settings.perplexity else None
        requested = list(settings.tasks)
        with_text_task = False
        if self.text is not None:
            if self.text.lm_eval_task:  # e.g. wikitext: lm-eval's own task over the same text
                requested.append(self.text.lm_eval_task)
            else:
                with_text_task = True
        self.plan = lmeval.plan_tasks(requested, with_text_task=with_text_task)
        if self.plan.hub:
            require_hub(f"lm-eval task(s) {', '.join(self.plan.hub)}")
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="normswap-eval-")
            workdir = Path(self._tmp.name)
        # a task folder other than the bundled one renders its templates in Jinja's sandbox
        self.sandboxed = bool(self.plan.local) and not settings.trust_remote_code and (
            lmeval.evals_dir().resolve() != lmeval.BUNDLED_EVALS.resolve())
        self.task_dir = lmeval.materialise_tasks(workdir / "tasks", self.plan.local, self.text,
                                                 trust_remote_code=settings.trust_remote_code)
        self._task_manager = None
        self._loaded_tasks: list | None = None
        self._encodings: dict[str, dict] = {}  # tokenizer fingerprint -> encoded strings, across models
        self.max_length = settings.max_length

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _tasks(self):
        if self._task_manager is None and self.plan.all:
            self._task_manager = lmeval.make_task_manager(self.plan, self.task_dir)
        return self._task_manager

    def _task_list(self) -> list:
        # Built once, so the second model of a comparison does not read and prepare the data again.
        if self._loaded_tasks is None:
            self._loaded_tasks = lmeval.load_tasks(self._tasks(), self.plan.all, sandboxed=self.sandboxed)
        return self._loaded_tasks

    def _fix_max_length(self, model) -> int:
        # Fixed by the first model evaluated, so every later model uses the same windows.
        if self.max_length is None:
            self.max_length = model_max_length(model)
            if self.max_length is None:
                raise NormswapError("the model config states no context length; pass --max-length")
        limit = model_max_length(model)
        if limit is not None and self.max_length > limit:
            raise NormswapError(f"--max-length {self.max_length} exceeds the model's context length {limit}")
        return self.max_length

    def evaluate(self, label: str, source: str) -> ModelEval:
        """Load ``source`` and score it; the model is released before returning."""
        result = ModelEval(label=label, source=str(source))
        started = time.perf_counter()
        if data_parallel_world() > 1:
            return self._evaluate_data_parallel(result, started)
        return self._scored(result, [*load_for_eval(source, self.settings)], started)

    def evaluate_pair(self, baseline: str, model: str) -> tuple[ModelEval, ModelEval]:
        """The baseline's scores (``original``) and the model's (``converted``), side by side
        where that finishes sooner (see the module docstring), else one after the other.

        Side by side, the baseline is loaded here first, which fixes ``max_length`` and builds the
        tasks as one at a time would, and is then scored by a forked copy of this process, which
        shares its memory. Both models are in memory at once, so they must fit in half the memory
        the system has free (the model's size taken as the baseline's, plus half for an untied
        head). The copy's scores come back as JSON, exactly."""
        cores = self._side_by_side_cores()
        if cores is None:
            return _one_at_a_time(self.evaluate("original", baseline), self.evaluate("converted", model))
        original = ModelEval(label="original", source=str(baseline))
        started = time.perf_counter()
        held = [*load_for_eval(baseline, self.settings)]
        available = available_memory()
        size = sum(t.nbytes for t in (*held[0].parameters(), *held[0].buffers()))
        if available is None or 2.5 * size > available / 2:
            return _one_at_a_time(self._scored(original, held, started), self.evaluate("converted", model))
        original.details["side_by_side"] = True
        self._fix_max_length(held[0])
        if self.plan.all:
            self._task_list()
        copy = background.InProcess(_ScoredAlone(self, original, held, started), name=f"the evaluation of {baseline}")
        # the copy holds its own; this process's are freed by their counts before the model loads. No
        # collection here: an interrupt that lands in one of its callbacks is swallowed
        held.clear()
        try:
            with pinned_threads(cores - 1):
                converted = self._scored_beside(model, copy)
        except BaseException:
            copy.cancel()
            raise
        converted.details["side_by_side"] = True
        return ModelEval.from_json(copy.result()), converted

    def _scored_beside(self, source: str, copy: background.InProcess) -> ModelEval:
        """The model's scores while ``copy`` scores the baseline. Every forward pass checks the
        copy first, so that its failure, or its death, stops this model at once."""
        result = ModelEval(label="converted", source=str(source))
        started = time.perf_counter()
        held = [*load_for_eval(source, self.settings)]
        held[0].register_forward_pre_hook(lambda module, args: copy.check())
        copy.check()
        return self._scored(result, held, started)

    def _side_by_side_cores(self) -> int | None:
        """The idle cores when the two models of a comparison are to be scored side by side
        (two or three, on a CPU, with a fork, the thread count not the user's), else None."""
        settings = self.settings
        if not (settings.side_by_side and settings.share_contexts) or settings.device_map or settings.threads:
            return None
        if (settings.device or _default_device()) != "cpu" or data_parallel_world() > 1:
            return None
        if sys.platform != "linux" or not hasattr(os, "fork"):
            return None
        cores = default_threads()
        return cores if cores in (2, 3) else None

    def _scored(self, result: ModelEval, held: list, started: float) -> ModelEval:
        """``result`` with the scores of the model ``held`` holds with its tokenizer; ``held`` is
        emptied, so the model is freed before this returns."""
        model, tokenizer = held
        held.clear()
        on_cpu = next(model.parameters()).device.type == "cpu"
        try:
            with cpu_threads(self.settings.threads) if on_cpu else nullcontext():
                self._score(result, model, tokenizer)
        finally:
            del model, tokenizer
            release_memory()
        result.details["seconds"] = round(time.perf_counter() - started, 2)
        return result

    def _score(self, result: ModelEval, model, tokenizer) -> None:
        max_length = self._fix_max_length(model)
        if self.text is not None:
            self._strided(result, model, tokenizer, max_length)
        if self.plan.all:
            lm = lmeval.make_lm(model, tokenizer, batch_size=self.settings.batch_size, max_length=max_length,
                                progress=self.settings.progress,
                                share_contexts=self.settings.share_contexts, encodings=self._encodings)
            self._record_tasks(result, lmeval.run_tasks(lm, self._tasks(), self._task_list(), limit=self.settings.limit,
                                                            sandboxed=self.sandboxed))

    def _strided(self, result: ModelEval, model, tokenizer, max_length: int) -> None:
        assert self.text is not None
        ids = tokenize_text(tokenizer, self.text.joined)
        stride = self.settings.stride or max_length
        strided = strided_perplexity(
            model, ids, max_length=max_length, stride=stride,
            batch_size=self.settings.batch_size, progress=self.settings.progress,
        )
        result.metrics[f"{STRIDED_TASK}/token_perplexity"] = strided.token_perplexity
        result.details[STRIDED_TASK] = strided.as_dict()
        # Windows play the role of documents for the per-document comparison.
        result.per_doc[STRIDED_TASK] = {i: [-nll] for i, nll in enumerate(strided.window_nll)}

    def _record_tasks(self, result: ModelEval, tasks: lmeval.TaskResults) -> None:
        for task, metrics in tasks.metrics.items():
            for metric, value in metrics.items():
                result.metrics[f"{task}/{metric}"] = value
        result.per_doc.update(tasks.per_doc)
        result.details["lm_eval_docs"] = tasks.n_docs

    def _evaluate_data_parallel(self, result: ModelEval, started: float) -> ModelEval:
        """Under ``accelerate launch``: lm-eval loads the checkpoint per process and shards the data.

        Strided perplexity is not sharded; it runs on the main process only.
        """
        from lm_eval.models.huggingface import HFLM


        path = resolve_source(result.source, trust_remote_code=self.settings.trust_remote_code)
        lm = HFLM(
            pretrained=str(path), dtype=self.settings.dtype, batch_size=self.settings.batch_size,
            max_length=self.settings.max_length, trust_remote_code=self.settings.trust_remote_code,
        )
        max_length = self._fix_max_length(lm.model)
        if self.text is not None and lm.rank == 0:
            self._strided(result, lm.model, lm.tokenizer, max_length)
        if self.plan.all:
            self._record_tasks(result, lmeval.run_tasks(lm, self._tasks(), self._task_list(), limit=self.settings.limit,
                                                            sandboxed=self.sandboxed))
        result.details["seconds"] = round(time.perf_counter() - started, 2)
        result.details["data_parallel_processes"] = data_parallel_world()
        return result


def _one_at_a_time(original: ModelEval, converted: ModelEval) -> tuple[ModelEval, ModelEval]:
    """The pair, each marked as scored alone (``details["side_by_side"]``: what ran, where the
    settings say what was asked)."""
    for result in (original, converted):
        result.details["side_by_side"] = False
    return original, converted


class _ScoredAlone:
    """The baseline's scoring as work for a forked copy (``background.InProcess``): on its one
    core, without progress bars (the model's own run draws them, and the copy's would be drawn over
    them), its ``ModelEval`` as JSON.
    ``held`` holds the model and its tokenizer (``Evaluator._scored``); the parent empties it once
    the copy is made."""

    def __init__(self, evaluator: Evaluator, result: ModelEval, held: list, started: float) -> None:
        self.evaluator, self.result, self.held, self.started = evaluator, result, held, started

    def work_alone(self) -> None:
        self.evaluator.settings = replace(self.evaluator.settings, progress=False)
        lmeval.bars_off_by_default()
        with pinned_threads(1):
            self.evaluator._scored(self.result, self.held, self.started)

    def figures(self) -> dict:
        return self.result.as_json()
