"""The shape of a local lm-eval task YAML, checked before lm-eval builds a task from it.

lm-eval builds its ``TaskConfig`` from whatever the YAML holds: an unknown key is a ``TypeError``
from the dataclass, a string ``class:`` is called, a string ``filter_list`` is indexed as if it
were a list of mappings. The keys that take a Python object (``class``, ``process_docs``,
``custom_dataset``) are valid only as ``!function`` tags, which ``task_code`` lets run only with
``--trust-remote-code``. ``check_task`` holds every other value to the type lm-eval uses it as,
in one line naming the file and the key.
"""

from __future__ import annotations

from typing import Any

from normswap.errors import NormswapError
from normswap.evaluation.task_code import Tagged, registered

_TEXT = (str,)
_TEMPLATE = (str, int, list)
# every key lm-eval reads from a task YAML, and the types its value may have when read as data
TASK_KEYS: dict[str, tuple[type, ...]] = {
    "task": _TEXT, "task_alias": _TEXT, "tag": (str, list), "group": (str, list), "include": _TEXT,
    "dataset_path": _TEXT, "dataset_name": _TEXT, "dataset_kwargs": (dict,), "training_split": _TEXT,
    "validation_split": _TEXT, "test_split": _TEXT, "fewshot_split": _TEXT, "doc_to_text": _TEMPLATE,
    "doc_to_target": _TEMPLATE, "doc_to_choice": (str, dict, list), "doc_to_image": _TEMPLATE,
    "doc_to_audio": _TEMPLATE, "process_results": _TEXT, "use_prompt": _TEXT, "description": _TEXT,
    "target_delimiter": _TEXT, "fewshot_delimiter": _TEXT, "fewshot_config": (dict,), "num_fewshot": (int,),
    "metric_list": (list,), "output_type": _TEXT, "generation_kwargs": (dict,), "repeats": (int,),
    "filter_list": (list,), "should_decontaminate": (bool,), "doc_to_decontamination_query": _TEXT,
    "gen_prefix": _TEXT, "metadata": (dict,), "unsafe_code": (bool,),
}
# keys whose value is Python code (a class or a function), which a YAML read as data cannot hold
CODE_KEYS = ("class", "process_docs", "custom_dataset")
OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until", "multiple_choice")
# the generation settings checked, with the range each may take; MAX_GEN_TOKS bounds a generation
# far above any model's window, so a mistyped count is refused before the model loads
MAX_GEN_TOKS = 1 << 20
_GENERATION_RANGES = (("max_gen_toks", 1, MAX_GEN_TOKS), ("temperature", 0, 100), ("top_p", 0, 1),
                      ("top_k", 1, 1 << 20))
_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "a mapping", bool: "true or false"}


def check_task(config: dict[str, Any], where: str) -> None:
    """Refuse a task YAML (``config``, from the file ``where``) that lm-eval could not build."""
    for key, value in config.items():
        if isinstance(value, Tagged):
            continue  # code (``!function``): runs only where ``task_code`` allows it
        if key in CODE_KEYS:
            raise NormswapError(f"{where}: '{key}' must be Python code (a !function tag), not {_show(value)}")
        kinds = TASK_KEYS.get(key)
        if kinds is None:
            raise NormswapError(f"{where}: '{key}' is not a key lm-eval task files have")
        if value is not None and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
            raise NormswapError(f"{where}: '{key}' must be {' or '.join(_NAMES[kind] for kind in kinds)} "
                                f"(got {_show(value)})")
    if config.get("output_type", "generate_until") not in OUTPUT_TYPES:
        raise NormswapError(f"{where}: 'output_type' must be one of {', '.join(OUTPUT_TYPES)} "
                            f"(got {_show(config['output_type'])})")
    for key in ("num_fewshot", "repeats"):
        if isinstance(config.get(key), int) and config[key] < (1 if key == "repeats" else 0):
            raise NormswapError(f"{where}: '{key}' must not be {config[key]}")
    for entry in _data(config, "metric_list"):
        if not (isinstance(entry, dict) and isinstance(entry.get("metric"), str)):
            raise NormswapError(f"{where}: every entry of 'metric_list' must be a mapping with a 'metric' name "
                                f"(got {_show(entry)})")
        _check_aggregation(entry, where)
    for entry in _data(config, "filter_list"):
        steps = entry.get("filter") if isinstance(entry, dict) else None
        if not (isinstance(entry.get("name") if isinstance(entry, dict) else None, str) and isinstance(steps, list)
                and all(isinstance(step, dict) and isinstance(step.get("function"), str) for step in steps)):
            raise NormswapError(f"{where}: every entry of 'filter_list' must be a mapping with a 'name' and a "
                                f"'filter' list of {{function: ...}} steps (got {_show(entry)})")
        for step in steps:
            _check_filter(step, where)
    _check_generation(_data(config, "generation_kwargs", {}), where)


def _data(config: dict[str, Any], key: str, empty: Any = ()) -> Any:
    """``config[key]`` where it is data; ``empty`` where it is absent or code (a ``!function`` tag)."""
    value = config.get(key)
    return empty if value is None or isinstance(value, Tagged) else value


def _check_aggregation(entry: dict[str, Any], where: str) -> None:
    if not isinstance(entry.get("higher_is_better", True), bool):
        raise NormswapError(f"{where}: 'higher_is_better' of the metric {_show(entry['metric'])} must be true or false")
    aggregation = entry.get("aggregation")
    if aggregation is None or isinstance(aggregation, Tagged):
        return  # lm-eval's default for the metric, or code (``task_code`` decides whether it runs)
    if not isinstance(aggregation, str) or aggregation not in registered("aggregation"):
        raise NormswapError(f"{where}: the aggregation {_show(aggregation)} of the metric {_show(entry['metric'])} "
                            f"is not one lm-eval registers ({', '.join(sorted(registered('aggregation')))})")


def _check_filter(step: dict[str, Any], where: str) -> None:
    function = step["function"]
    if function not in registered("filter"):
        raise NormswapError(f"{where}: the filter {_show(function)} is not one lm-eval registers "
                            f"({', '.join(sorted(registered('filter')))})")
    code = step.get("filter_fn")
    if function == "custom" and not (isinstance(code, Tagged) and code.tag == "!function"):
        raise NormswapError(f"{where}: the custom filter's 'filter_fn' must be Python code (a !function tag), "
                            f"not {_show(code)}")


def _check_generation(kwargs: dict[str, Any], where: str) -> None:
    """``generation_kwargs`` as lm-eval and ``generate`` use them (the model's own window is
    checked against ``max_gen_toks`` once it is loaded: ``check_generation_fits``)."""
    until = kwargs.get("until")
    if until is not None and not (isinstance(until, str) or (isinstance(until, list)
                                                              and all(isinstance(item, str) for item in until))):
        raise NormswapError(f"{where}: generation_kwargs 'until' must be a string or a list of strings")
    for key, low, high in _GENERATION_RANGES:
        value = kwargs.get(key)
        integer = key in ("max_gen_toks", "top_k")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not low <= value <= high:
            raise NormswapError(f"{where}: generation_kwargs '{key}' must be {'an integer' if integer else 'a number'} "
                                f"from {low:,} to {high:,} (got {_show(value)})")
    if not isinstance(kwargs.get("do_sample", False), bool):
        raise NormswapError(f"{where}: generation_kwargs 'do_sample' must be true or false")


def check_generation_fits(tasks: list, max_length: int, default_max_gen_toks: int) -> None:
    """Refuse a generating task whose ``max_gen_toks`` leaves no room for a prompt in the model's
    window (lm-eval asserts it mid-run)."""
    for task in tasks:
        config = getattr(task, "config", None)
        if getattr(config, "output_type", None) != "generate_until":
            continue
        wanted = (getattr(config, "generation_kwargs", None) or {}).get("max_gen_toks", default_max_gen_toks)
        if isinstance(wanted, int) and wanted >= max_length:
            raise NormswapError(f"task {getattr(task, 'task_name', '?')!r:.60} asks for max_gen_toks {wanted}, which "
                                f"leaves no room for a prompt in the model's max length {max_length}; lower it or "
                                "pass a larger --max-length")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
