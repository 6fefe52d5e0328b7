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
from normswap.evaluation.task_code import Tagged

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
    for entry in config.get("metric_list") or []:
        if not (isinstance(entry, dict) and isinstance(entry.get("metric"), str)):
            raise NormswapError(f"{where}: every entry of 'metric_list' must be a mapping with a 'metric' name "
                                f"(got {_show(entry)})")
    for entry in config.get("filter_list") or []:
        steps = entry.get("filter") if isinstance(entry, dict) else None
        if not (isinstance(entry.get("name") if isinstance(entry, dict) else None, str) and isinstance(steps, list)
                and all(isinstance(step, dict) and isinstance(step.get("function"), str) for step in steps)):
            raise NormswapError(f"{where}: every entry of 'filter_list' must be a mapping with a 'name' and a "
                                f"'filter' list of {{function: ...}} steps (got {_show(entry)})")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
