"""The package's layers run one way, and no module imports itself back through others.

Every module under ``normswap/`` is parsed (nothing is imported); every import counts, at any
depth: module level, inside functions, under ``TYPE_CHECKING``. A module may import its own layer
or one below it, never one above (docs/layout.md draws the order).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "normswap"

# lowest first; a module's layer is the first entry its dotted name starts with
LAYERS: list[tuple[str, ...]] = [
    ("normswap.errors", "normswap.arguments", "normswap.lazy", "normswap.dtypes", "normswap.extras", "normswap.memory",
     "normswap.threads"),
    ("normswap.text",),
    ("normswap.checkpoint",),
    ("normswap.kernels",),
    ("normswap.architectures", "normswap.modeling"),
    ("normswap.runtime", "normswap.evaluation.perplexity"),
    ("normswap.convert",),
    ("normswap.rotate",),
    ("normswap.verify",),
    ("normswap.api", "normswap.evaluation", "normswap.analysis"),
    ("normswap.commands", "normswap.evaluation.cli", "normswap.evaluation.recipe_cli", "normswap.analysis.cli"),
    ("normswap.cli", "normswap.__main__", "normswap"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in ROOT.rglob("*.py")}


def imported(name: str, path: Path, nodes: list[ast.AST] | None = None) -> set[str]:
    """The normswap modules ``name`` imports anywhere in its source (or in the import ``nodes``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in nodes if nodes is not None else ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    targets = set()
    for target in found:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.add(target)
    return targets


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def layer(name: str) -> int:
    """The layer of the longest entry of LAYERS that names ``name`` or a package above it."""
    best = (-1, None)
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix != "normswap" and (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), index)
    if best[1] is not None:
        return best[1]
    if name == "normswap":
        return len(LAYERS) - 1
    pytest.fail(f"{name} is in no layer: add it to LAYERS (and docs/layout.md)")


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


def test_imports_point_down_the_layers():
    upward = sorted(f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
                    for name, targets in GRAPH.items() for target in targets
                    if target != "normswap" and layer(target) > layer(name))
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    assert not cycles, cycles


def test_at_most_twelve_top_level_modules():
    top = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(top) <= 12, top


def documented_modules() -> set[str]:
    """The modules docs/layout.md's module map names, as paths under normswap/: a line that
    starts with ``name/`` opens a package, nested by indentation; the ``.py`` names that start a
    line belong to the package above them."""
    text = (ROOT.parent / "docs" / "layout.md").read_text(encoding="utf-8")
    block = text.split("## Modules", 1)[1].split("```")[1]
    packages: list[tuple[int, str]] = []
    named = set()
    for line in block.splitlines():
        words = line.split()
        if not words:
            continue
        indent = len(line) - len(line.lstrip())
        while packages and packages[-1][0] >= indent:
            packages.pop()
        if words[0].endswith("/"):
            packages.append((indent, words[0]))
            continue
        prefix = "".join(package for _, package in packages[1:])  # below normswap/ itself
        for word in words:
            if not word.endswith(".py"):
                break
            named.add(prefix + word)
    return named


def test_the_layout_doc_names_every_module():
    modules = {str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py")
               if path.name != "__init__.py" or path.parent == ROOT}
    named = documented_modules()
    assert sorted(modules - named) == [], "modules docs/layout.md does not name"
    assert sorted(named - modules) == [], "docs/layout.md names modules that do not exist"


def test_package_docstrings_list_their_own_modules():
    from normswap.architectures import SHARED_MODULES

    for init in ROOT.rglob("__init__.py"):
        if init.parent == ROOT:
            continue
        own = {path.stem for path in init.parent.glob("*.py") if path.name != "__init__.py"}
        own |= {path.name for path in init.parent.iterdir() if (path / "__init__.py").exists()}
        if init.parent.name == "architectures":  # the adapters are found, not listed
            own &= SHARED_MODULES
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        bullets = [line[4:line.index("``", 4)] for line in doc.splitlines() if line.startswith("- ``")]
        where = init.parent.relative_to(ROOT)
        assert set(bullets) <= own, f"{where}'s docstring lists modules it does not hold"
        assert sorted(name for name in own if f"``{name}``" not in doc) == [], f"{where}'s docstring misses modules"


def _loaded_at_import(name: str) -> set[str]:
    """The normswap modules importing ``name`` loads: its packages and, transitively, what each
    module on the way imports at module level (``TYPE_CHECKING`` blocks aside)."""
    loaded: set[str] = set()
    todo = [name]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for end in range(1, len(parts) + 1):
            package = ".".join(parts[:end])
            if package in loaded or package not in MODULES:
                continue
            loaded.add(package)
            tree = ast.parse(MODULES[package].read_text(encoding="utf-8"))
            nodes = [node for statement in tree.body
                     for node in ([statement] if not isinstance(statement, ast.Try) else statement.body)
                     if isinstance(node, (ast.Import, ast.ImportFrom))]
            todo.extend(imported(package, MODULES[package], nodes))
    return loaded


def test_imports_inside_functions_defer_something():
    """An import inside a function is there to keep start-up light (``normswap --help``,
    ``import normswap``): it defers a module that importing its own module does not load. One
    that the module loads anyway belongs at the top. ``from normswap import name`` defers the
    lazy public API and is left out."""
    needless = []
    for name, path in MODULES.items():
        if path == ROOT / "modeling" / "remote.py":  # copied into every checkpoint as one self-contained file
            continue
        loaded = _loaded_at_import(name)
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    targets = imported(name, path, [node]) - {"normswap"}
                    if targets and targets <= loaded:
                        needless.append(f"{path.relative_to(ROOT)}:{node.lineno} {', '.join(sorted(targets))}")
    assert not needless, "imported inside a function but loaded with the module anyway:\n" + "\n".join(needless)
