"""The package's layout, read from its source with ``ast``: imports run one way, and the folders a new file is added
to (methods, generator families, rewards) are read by their packages, so adding one needs no other edit.

The graph has one node per module of ``lit/``, ``modules/``, ``datamodules/`` and ``callbacks/`` and one arrow per
import, wherever it is written: at the top, inside a function, under ``TYPE_CHECKING``. An import of ``a.b.c`` is an
arrow to ``a.b.c`` and, as Python runs them first, to the packages ``a.b`` and ``a`` — except those that hold the
importing module (a module inside a package runs after its package's ``__init__`` began; importing a sibling does not
run that ``__init__`` again). A package whose ``__init__`` discovers its modules with ``pkgutil`` (the generator
families, the rewards, the methods) imports every one of them.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = ("lit", "modules", "datamodules", "callbacks")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def _python_files(folder: str):
    for parent, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "assets"))
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(parent, name)


def _module_name(path: str) -> str:
    parts = os.path.relpath(path, ROOT)[:-len(".py")].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["posttrain", *parts])


def _imported(tree: ast.AST, name: str, is_package: bool) -> list[str]:
    """Every module name an import statement of module ``name`` names (``from a import b``: ``a.b`` and ``a``, the
    caller keeps the one that is a module), relative imports resolved."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found += [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            found.append(node.args[0].value)
    return found


def _discovers(tree: ast.AST) -> bool:
    """Whether a package's ``__init__`` imports its own modules by ``pkgutil.iter_modules(__path__)``."""
    return any(isinstance(node, ast.Attribute) and node.attr == "iter_modules" for node in ast.walk(tree))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """(module -> the package modules it imports, module -> every module name it imports)."""
    paths = {_module_name(path): path for folder in PACKAGE for path in _python_files(folder)}
    graph: dict[str, set[str]] = {}
    raw: dict[str, list[str]] = {}
    for name, path in paths.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        raw[name] = _imported(tree, name, is_package)
        arrows: set[str] = set()
        for target in raw[name]:
            while target not in paths and "." in target:  # `from a.b import name`: the module a.b
                target = target.rsplit(".", 1)[0]
            if target not in paths:
                continue  # not this package's
            if target != name:
                arrows.add(target)
            arrows.update(p for p in _ancestors(target) if p in paths and p not in _ancestors(name) and p != name)
        if is_package and _discovers(tree):
            arrows.update(m for m in paths if m.rsplit(".", 1)[0] == name)
        graph[name] = arrows
    return graph, raw


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph[child]))))
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
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_circle():
    """Every strongly connected component of the import graph is one module: no import, type-only or inside a
    function, runs back to a module that imports it (a circle is named with its arrows)."""
    graph, _ = import_graph()
    assert len(graph) > 80, f"the graph has {len(graph)} modules; the walk missed the package"
    found = circles(graph)
    described = [" ; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(described)


def test_the_circle_finder_finds_a_circle():
    """The check above can fail: a made-up graph with a three-module circle and a self-contained tail."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_modules_datamodules_and_callbacks_never_import_lit():
    graph, _ = import_graph()
    wrong = {m: sorted(t for t in targets if t == "posttrain.lit" or t.startswith("posttrain.lit."))
             for m, targets in graph.items()
             if m.startswith(("posttrain.modules", "posttrain.datamodules", "posttrain.callbacks"))}
    assert not {m: t for m, t in wrong.items() if t}, wrong


def test_modules_never_import_lightning():
    _, raw = import_graph()
    wrong = {m: sorted({t for t in names if t.split(".")[0] in LIGHTNING})
             for m, names in raw.items() if m.startswith("posttrain.modules")}
    assert not {m: t for m, t in wrong.items() if t}, wrong


def test_nothing_imports_experiments():
    """The research scripts of ``experiments/`` run as ``python -m experiments.<name>``; the package, the tests, the
    benches and the asset scripts never import them."""
    wrong = []
    for folder in (*PACKAGE, "tests", "bench", "scripts"):
        for path in _python_files(folder):
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            names = _imported(tree, _module_name(path), path.endswith("__init__.py"))
            if any(n == "experiments" or n.startswith(("experiments.", "posttrain.experiments")) for n in names):
                wrong.append(os.path.relpath(path, ROOT))
    assert not wrong, f"these import experiments/: {wrong}"


def test_the_top_of_modules_holds_at_most_ten_entries():
    """``modules/`` is rooms (models, flow, rl, distill, rewards, world, eval, io, assets), not a flat list of files."""
    entries = sorted(e for e in os.listdir(os.path.join(ROOT, "modules")) if e != "__pycache__")
    assert len(entries) <= 10, entries


def test_every_method_file_is_read_by_the_package():
    """``lit/__init__.py`` finds the methods by reading its folder: every ``ExpertModule`` subclass of every module of
    ``lit/`` is a name of ``posttrain.lit`` (what ``model: {class_path: <Name>}`` resolves), the shims and the
    ``engine``/``tools`` rooms define none."""
    import importlib
    import pkgutil

    import posttrain.lit as lit
    from posttrain.lit.base import ExpertModule

    defined = {name for info in pkgutil.iter_modules(lit.__path__) if not info.ispkg
               for name, value in vars(importlib.import_module(f"posttrain.lit.{info.name}")).items()
               if isinstance(value, type) and issubclass(value, ExpertModule) and value is not ExpertModule
               and value.__module__ == f"posttrain.lit.{info.name}"}
    assert {"Finetune", "FlowGRPO", "DiffusionNFT", "JointRL", "DMD2", "Workflow", "WorkflowRL"} <= defined
    assert defined == set(lit.METHODS) and defined <= set(lit.__all__)
