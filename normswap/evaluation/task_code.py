"""A task folder is code: what in an lm-eval task YAML runs Python, found before lm-eval reads it.

lm-eval imports and runs a ``!function`` tag's module, follows ``include:`` to any file (which may
hold one), builds a ``class:`` named by the YAML, and renders ``doc_to_*`` Jinja templates in an
unsandboxed environment, where ``{{ cycler.__init__.__globals__.os.system(...) }}`` runs a
command. A ``metric_list`` entry naming a metric outside lm-eval's registry, or marked
``hf_evaluate: true``, goes to ``evaluate.load``, which imports a local folder's script or
fetches one from the Hub: such a metric is code too. Tasks bundled with normswap (``normswap/evals/`` beside the package) and lm-eval's own are
trusted; a folder named by ``NORMSWAP_EVALS_DIR`` runs such code only with
``--trust-remote-code``, as a checkpoint's does. Without it, ``code_in`` names the first such
construct and the task is refused; its templates are then rendered in Jinja's sandbox too
(``sandboxed_templates``), which refuses any reach into Python internals that a check missed,
and any string, list or output longer than ``TEMPLATE_LIMIT`` before it is built.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml

from normswap.errors import NormswapError, quoted

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
    known = registered("metric")
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


def registered(kind: str) -> frozenset[str]:
    """The names in one of lm-eval's registries (``metric``, ``aggregation``, ``filter``), filled
    when its metrics and filters modules load."""
    import lm_eval.api.metrics  # noqa: F401 (registers the metrics and aggregations)
    import lm_eval.filters  # noqa: F401 (registers the filters)
    from lm_eval.api import registry

    return frozenset(getattr(registry, f"{kind}_registry"))


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
    sandbox = _bounded(SandboxedEnvironment)(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    sandbox.filters.update(original.filters)
    for name in _WIDTH_FILTERS:
        sandbox.filters[name] = _width_checked(sandbox.filters[name])
    utils.env = sandbox
    try:
        yield
    finally:
        utils.env = original


# the longest string or list (and the widest integer, in bits) a sandboxed template may build:
# far above any prompt, far below what would exhaust memory
TEMPLATE_LIMIT = 1_000_000
# filters whose integer arguments set the size of what they build
_WIDTH_FILTERS = ("center", "indent", "format", "wordwrap", "truncate")


def _too_large(what: str) -> NormswapError:
    return NormswapError(f"a task template builds {what} (at most {TEMPLATE_LIMIT:,} may be built)")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before Python computes it, an operation whose result would exceed ``TEMPLATE_LIMIT``."""
    sized = (str, list, tuple)
    if operator == "*" and isinstance(left, int) and isinstance(right, sized):
        left, right = right, left
    if operator == "*" and isinstance(left, sized) and isinstance(right, int) and len(left) * right > TEMPLATE_LIMIT:
        raise _too_large(f"a repetition of {len(left) * right:,} items")
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > TEMPLATE_LIMIT:
        raise _too_large(f"a concatenation of {len(left) + len(right):,} items")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right * left.bit_length() > TEMPLATE_LIMIT:
        raise _too_large(f"a power of about {right * left.bit_length():,} bits")
    if operator == "%" and isinstance(left, str):
        _check_widths(right if isinstance(right, tuple) else (right,))


def _check_widths(arguments: Any) -> None:
    for value in arguments:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > TEMPLATE_LIMIT:
            raise _too_large(f"text {abs(value):,} characters wide")


def _bounded(sandbox: type) -> type:
    """Jinja's sandbox, which also refuses operations (and output) larger than ``TEMPLATE_LIMIT``
    and turns arithmetic errors (``1 / 0``) into one line."""

    class BoundedSandbox(sandbox):
        intercepted_binops = frozenset(sandbox.default_binop_table)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            try:
                return super().call_binop(context, operator, left, right)
            except ArithmeticError as error:
                raise NormswapError(f"a task template fails: {type(error).__name__}: {error}") from None

        @staticmethod
        def concat(chunks: Any) -> str:
            parts, size = [], 0
            for chunk in chunks:
                size += len(chunk)
                if size > TEMPLATE_LIMIT:
                    raise _too_large(f"over {TEMPLATE_LIMIT:,} characters of output")
                parts.append(chunk)
            return "".join(parts)

    return BoundedSandbox


def _width_checked(jinja_filter: Any) -> Any:
    """``jinja_filter``, refusing integer arguments above ``TEMPLATE_LIMIT`` (``wraps`` keeps the
    mark by which Jinja passes it the environment or context)."""

    @functools.wraps(jinja_filter)
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_widths([*args[1:], *kwargs.values()])
        return jinja_filter(*args, **kwargs)

    return checked
