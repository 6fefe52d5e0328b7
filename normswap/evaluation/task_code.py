"""A task folder is code: what in an lm-eval task YAML runs Python, found before lm-eval reads it.

lm-eval imports and runs a ``!function`` tag's module, follows ``include:`` to any file (which may
hold one), builds a ``class:`` named by the YAML, and renders ``doc_to_*`` Jinja templates in an
unsandboxed environment, where ``{{ cycler.__init__.__globals__.os.system(...) }}`` runs a
command. A ``metric_list`` entry naming a metric outside lm-eval's registry, or marked
``hf_evaluate: true``, goes to ``evaluate.load``, which imports a local folder's script or
fetches one from the Hub: such a metric is code too. Tasks bundled with normswap (``evals/`` beside the package) and lm-eval's own are
trusted; a folder named by ``NORMSWAP_EVALS_DIR`` runs such code only with
``--trust-remote-code``, as a checkpoint's does. Without it, ``code_in`` names the first such
construct and the task is refused; its templates are then rendered in Jinja's sandbox too
(``sandboxed_templates``), which refuses any reach into Python internals that a check missed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml

from normswap.errors import quoted

# keys through which lm-eval builds a class or reads another file (which may hold a tag); the
# other keys run code only through a ``!function`` tag, found as ``Tagged``
_CODE_KEYS = {"class", "include"}
# Jinja filters and tests that reach attributes by a computed name
_ATTRIBUTE_FILTERS = {"attr", "map", "selectattr", "rejectattr", "groupby", "sort", "unique", "min", "max", "sum"}


class Tagged:
    """A YAML value carrying a tag (``!function utils.x``): kept as data, never constructed."""

    def __init__(self, tag: str, value: Any) -> None:
        self.tag = tag
        self.value = value


class TaskLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads any ``!tag`` as ``Tagged`` instead of failing or running it."""


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node)
    else:
        value = loader.construct_mapping(node)
    return Tagged("!" + suffix, value)


TaskLoader.add_multi_constructor("!", _tagged)


def code_in(config: Any, where: str = "") -> str | None:
    """What in a task config would run Python (``!function``, ``include:``, ``class:``, a template
    reaching attributes that start with ``_``), as a phrase naming it; None when nothing does."""
    if isinstance(config, Tagged):
        return f"a {config.tag} tag{' at ' + where if where else ''}"
    if isinstance(config, dict):
        for key, value in config.items():
            path = f"{where}.{key}" if where else str(key)
            if key in _CODE_KEYS and value not in (None, [], {}):
                return f"'{path}:'"
            if key == "metric_list":
                found = _metric_code(value, path)
                if found:
                    return found
            found = code_in(value, path)
            if found:
                return found
    elif isinstance(config, list):
        for index, item in enumerate(config):
            found = code_in(item, f"{where}[{index}]")
            if found:
                return found
    elif isinstance(config, str) and ("{{" in config or "{%" in config):
        if _reaches_internals(config):
            return f"a template at {where or 'the top'} that reaches Python internals"
    return None


def _metric_code(metric_list: Any, where: str) -> str | None:
    """What in a ``metric_list`` lm-eval would hand to ``evaluate.load`` (a metric name outside
    its registry, or any entry with ``hf_evaluate`` set), as a phrase naming it."""
    entries = metric_list if isinstance(metric_list, list) else [metric_list]
    known = _registered_metrics()
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        name = entry.get("metric")
        if entry.get("hf_evaluate") not in (None, False):
            return f"'{where}[{index}].hf_evaluate:' (a metric loaded through evaluate runs its script)"
        if isinstance(name, str) and name not in known:
            return (f"the metric {quoted(name)} at {where}[{index}], which is not in lm-eval's registry "
                    "(evaluate loads it by running its script)")
    return None


def _registered_metrics() -> frozenset[str]:
    """The metric names lm-eval computes itself (its registry, filled when its metrics module loads)."""
    import lm_eval.api.metrics  # noqa: F401 (registers the metrics)
    from lm_eval.api.registry import metric_registry

    return frozenset(metric_registry)


def _reaches_internals(template: str) -> bool:
    """Whether a Jinja template reads an attribute or item whose name starts with ``_``, or one
    chosen by a filter (``attr``, ``map(attribute=...)``): the ways out of a template to Python."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import SandboxedEnvironment

    try:
        tree = SandboxedEnvironment().parse(template)
    except TemplateSyntaxError:
        return False  # lm-eval reports it when it renders
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter, nodes.Test)):
        if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
            return True
        if isinstance(node, nodes.Getitem):
            key = node.arg
            if isinstance(key, nodes.Const) and isinstance(key.value, str) and key.value.startswith("_"):
                return True
            if isinstance(key, (nodes.Concat, nodes.BinExpr, nodes.Filter, nodes.Call)):
                return True  # a name built at render time, e.g. '__cla' ~ 'ss__'
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.name in _ATTRIBUTE_FILTERS:
            return True
    return False


@contextmanager
def sandboxed_templates(enabled: bool) -> Iterator[None]:
    """lm-eval renders its templates with Jinja's sandbox in this block (when ``enabled``)."""
    if not enabled:
        yield
        return
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval import utils

    original = utils.env
    sandbox = SandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    sandbox.filters.update(original.filters)
    utils.env = sandbox
    try:
        yield
    finally:
        utils.env = original
