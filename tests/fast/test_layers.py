"""The package's layers, checked from the source: every ``import`` of every module in
``rl_plugin/`` is parsed (``ast``, nothing is imported or run) into a graph of module -> the
``rl_plugin`` modules it names, and the rules below hold on that graph.

What counts as an import: ``import a.b``, ``from a.b import c`` (the module ``a.b``, and ``a.b.c``
where that is a module), at any depth: function-local imports and imports under
``if TYPE_CHECKING:`` too (a name imported only for annotations still ties the two modules: an
upward or circular one there is the same design problem, hidden from the interpreter only). A
package's ``__init__`` that a submodule import runs implicitly is not an edge (every sibling
import would otherwise be a circle through it).

The layer table (``LAYERS``, bottom to top) is data: a module may import its own layer and the
layers below. The rules:

- ``no_circle``: no import circle between modules (every strongly connected component is one module);
- ``no_upward_import``: no module imports a layer above its own;
- ``core_imports_core_and_foundations``: the loss core (``rl_plugin/loss``, ``cp.py``, ``parallel.py``)
  imports only itself and the foundations (so nothing of backends/, ray/, rollout/, loop/, arguments/,
  step_plan, configs, weight_sync/);
- ``core_through_package``: outside the core, the core is imported through its public faces
  only: the package ``rl_plugin.loss`` (never ``rl_plugin.loss.<module>``), ``rl_plugin.cp`` and
  ``rl_plugin.parallel`` (single modules that are their own interface);
- ``arguments_stay_at_the_cli``: only ``rl_plugin/arguments`` and the modules that parse or
  validate flags (``ARGUMENT_READERS``) import ``rl_plugin.arguments``.

``test_rule`` holds each rule over the whole package.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable, Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "rl_plugin"

# Bottom to top: (layer, module prefixes), as docs/design.md "Layers" lists them (top to bottom
# there). ``rl_plugin`` itself (the root package) matches only exactly; any other entry matches the
# module and everything under it.
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    (
        "foundations",
        (
            "rl_plugin",
            "rl_plugin.cp",
            "rl_plugin.parallel",
            "rl_plugin.tensor_pickle",
            "rl_plugin.registry_base",
            "rl_plugin.registries",
            "rl_plugin.user_code",
            "rl_plugin.errors",
            "rl_plugin.flags",
            "rl_plugin.loss_config",
            "rl_plugin.urls",
            "rl_plugin.routing",
            "rl_plugin.lora",
            "rl_plugin.models",
            "rl_plugin.threads",
            "rl_plugin.phases",
            "rl_plugin.invariant",
        ),
    ),
    ("loss core", ("rl_plugin.loss",)),
    ("weight sync", ("rl_plugin.weight_sync",)),
    ("configs and step plan", ("rl_plugin.configs", "rl_plugin.step_plan")),
    ("rollout", ("rl_plugin.rollout",)),
    ("checkpoint", ("rl_plugin.checkpoint",)),
    ("backends", ("rl_plugin.backends",)),
    ("ray", ("rl_plugin.ray",)),
    ("arguments", ("rl_plugin.arguments",)),
    ("loop", ("rl_plugin.loop", "rl_plugin.train")),
)
# The loss core of the rules below: the package and the two pure modules it is built on.
CORE = ("rl_plugin.cp", "rl_plugin.parallel", "rl_plugin.loss")
CORE_PUBLIC = {"rl_plugin.loss", "rl_plugin.cp", "rl_plugin.parallel"}
ARGUMENT_READERS = ("rl_plugin.arguments", "rl_plugin.train", "rl_plugin.loop")  # the CLI and its runner, the top layer

Graph = Dict[str, Set[str]]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or (prefix != PACKAGE and module.startswith(prefix + "."))


def _in(module: str, prefixes) -> bool:
    return any(_under(module, p) for p in prefixes)


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix matching ``module`` (-1: none)."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _under(module, p) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_names(source: str, module: str, is_package: bool) -> Set[str]:
    """Every dotted name an import statement of ``source`` names (see module docstring)."""
    names: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return names


def import_graph() -> Graph:
    files = {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}
    graph: Graph = {}
    for mod, path in files.items():
        named = imported_names(path.read_text(), mod, path.name == "__init__.py")
        graph[mod] = {n for n in named if n in files and n != mod}
    return graph


# -- the rules: each returns its violations as (importing module, message) -----------------------
def circles(graph: Graph) -> List[Tuple[str, str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    found: List[List[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return [(comp[0], "import circle: " + " <-> ".join(comp)) for comp in found]


def upward_imports(graph: Graph) -> List[Tuple[str, str]]:
    out = []
    for mod, targets in sorted(graph.items()):
        for t in sorted(targets):
            if layer_of(t) > layer_of(mod):
                out.append((mod, f"{mod} ({LAYERS[layer_of(mod)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"))
    return out


def core_imports_outside(graph: Graph) -> List[Tuple[str, str]]:
    allowed = CORE + LAYERS[0][1]  # itself and the foundations
    return [
        (mod, f"loss core module {mod} imports {t}")
        for mod, targets in sorted(graph.items())
        if _in(mod, CORE)
        for t in sorted(targets)
        if not _in(t, allowed)
    ]


def core_internals_imported(graph: Graph) -> List[Tuple[str, str]]:
    return [
        (mod, f"{mod} imports the loss core's internal module {t} (use rl_plugin.loss)")
        for mod, targets in sorted(graph.items())
        if not _in(mod, CORE)
        for t in sorted(targets)
        if _in(t, CORE) and t not in CORE_PUBLIC
    ]


def arguments_imported(graph: Graph) -> List[Tuple[str, str]]:
    return [
        (mod, f"{mod} imports {t} (only {', '.join(ARGUMENT_READERS)} read flags)")
        for mod, targets in sorted(graph.items())
        if not _in(mod, ARGUMENT_READERS)
        for t in sorted(targets)
        if _in(t, ("rl_plugin.arguments",))
    ]


RULES: Dict[str, Callable[[Graph], List[Tuple[str, str]]]] = {
    "no_circle": circles,
    "no_upward_import": upward_imports,
    "core_imports_core_and_foundations": core_imports_outside,
    "core_through_package": core_internals_imported,
    "arguments_stay_at_the_cli": arguments_imported,
}


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph()


def test_graph_sees_the_imports(graph):
    """The parser finds the edges it must: a plain, a package and a function-local import (the
    ``TYPE_CHECKING`` one: ``test_rules_catch_what_they_forbid``)."""
    assert len(graph) > 100
    assert "rl_plugin.loss.micro_batch_plan" in graph["rl_plugin.loss.runner"]
    assert "rl_plugin.loss" in graph["rl_plugin.backends.base"]
    assert "rl_plugin.backends.fsdp.model" in graph["rl_plugin.backends.fsdp.packing"]  # inside a function


def test_layer_table_covers_every_module(graph):
    assert [m for m in sorted(graph) if layer_of(m) < 0] == []


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule(graph, rule):
    assert [msg for _, msg in RULES[rule](graph)] == []


def test_rules_catch_what_they_forbid():
    """Each rule reports a planted violation (so a passing run means the rules looked)."""
    bad: Graph = {
        "rl_plugin.loss.step": {"rl_plugin.ray.cluster", "rl_plugin.loss.runner"},
        "rl_plugin.loss.runner": {"rl_plugin.loss.step"},
        "rl_plugin.backends.base": {"rl_plugin.loss.runner", "rl_plugin.arguments.training"},
        "rl_plugin.ray.cluster": set(),
        "rl_plugin.arguments.training": set(),
    }
    assert circles(bad) == [("rl_plugin.loss.runner", "import circle: rl_plugin.loss.runner <-> rl_plugin.loss.step")]
    assert [m for m, _ in upward_imports(bad)] == ["rl_plugin.backends.base", "rl_plugin.loss.step"]
    assert [m for m, _ in core_imports_outside(bad)] == ["rl_plugin.loss.step"]
    assert [m for m, _ in core_internals_imported(bad)] == ["rl_plugin.backends.base"]
    assert [m for m, _ in arguments_imported(bad)] == ["rl_plugin.backends.base"]
    names = imported_names(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rl_plugin.loop\nfrom . import cp\n",
        "rl_plugin.loss.step",
        False,
    )
    assert "rl_plugin.loop" in names and "rl_plugin.loss.cp" in names  # an import for annotations counts
