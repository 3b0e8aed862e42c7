"""The import graph of oomguard (every module of the checkout): no circle, layers one way.

The graph is built from the AST of every module, so it sees every import a run can make, not only
the ones executed at import time: module-level imports, imports inside functions and methods
(a function-level import hides a circle from Python, not from a reader), and the imports under
`if TYPE_CHECKING:` (they are not excluded: a type that needs the module above is a circle in
the design too). `from x import y` where `x.y` is a module counts as importing `x.y`.

Layers (docs/architecture.md):
- the twin (`oomguard.twin`: GPU, physics, executor, traces, gpufile) is product: it imports no
  lab module;
- the lab (`oomguard.lab`: runner, processes, routers, demo, report, charts, matrix, recovery)
  sits above everything: nothing outside the lab imports it except the CLI (`oomguard demo`);
- the core (`core/oomguard/*.py`) imports no component, except the few listed in CORE_ALLOWED
  with the reason each may; the packages in FOUNDATION sit below the core (anyone may import
  them; they import no component).
"""

from __future__ import annotations

import ast
from pathlib import Path

import oomguard

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "oomguard"

# core module -> the components it may import, and why (keep this short)
CORE_ALLOWED: dict[str, tuple[set[str], str]] = {
    "oomguard.cli": (
        {"*"},
        "the CLI composes every component, each inside its own subcommand",
    ),
    "oomguard.gpucheck": (
        {"exporter", "vllm_plugin", "twin", "forensics"},
        "scripts/gpu-check: checks the exporter's and the plugin's GPU readings on a real GPU, and "
        "reads the OOM record back as the forensics do",
    ),
    "oomguard.status": (
        {"exporter"},
        "`oomguard status` reads the exporters' /metrics with the exporter's own text parser",
    ),
}
LAB_USERS = {"oomguard.cli"}  # outside the lab, only these may import it
# packages below the core: every module may import them, and they import no component
FOUNDATION: dict[str, str] = {
    "vllm_seam": "what oomguard knows of vLLM (names, routes, defaults), one module per version",
}


def roots() -> list[Path]:
    """The checkout's folders that hold `oomguard`: one per import root (core/oomguard,
    exporter/oomguard, ...), the namespace package's parts."""
    found = sorted({Path(p).resolve() for p in oomguard.__path__})
    return [p for p in found if p.is_relative_to(ROOT)]


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the checkout: import name -> (file, is a package's __init__)."""
    out: dict[str, tuple[Path, bool]] = {}
    for root in roots():
        for path in sorted(root.rglob("*.py")):
            parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out[".".join(parts)] = (path, is_package)
    return out


def _imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The oomguard modules one module's AST imports, wherever the import statement is."""
    here = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
    # `import a.b.c` and `from a.b import c` (c a name, not a module): the deepest known module
    resolved = set()
    for target in out:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target.startswith(PACKAGE) and target != name:
            resolved.add(target)
    return resolved


MODULES = modules()


def import_graph() -> dict[str, set[str]]:
    known = set(MODULES)
    return {
        name: _imported(ast.parse(path.read_text(), str(path)), name, is_package, known)
        for name, (path, is_package) in MODULES.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
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


def _circle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One circle through the component's first member, for the message: a -> b -> ... -> a."""
    inside = set(members)
    start = members[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & inside):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    nxt.append(child)
        frontier = nxt
    return members


def _component(name: str) -> str | None:
    """`exporter` for oomguard.exporter.x; None for a core module (core/oomguard/*.py)."""
    parts = name.split(".")
    is_package = name in MODULES and MODULES[name][1]
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and is_package) else None


GRAPH = import_graph()


def test_the_graph_sees_function_level_and_type_checking_imports():
    """The builder itself: an import inside a function body, one under TYPE_CHECKING and a
    submodule named in `from package import module` are all edges."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from oomguard.a import A\n"
        "def f():\n    from oomguard.b import thing\n"
        "from oomguard import c\n"
    )
    known = {"oomguard", "oomguard.a", "oomguard.b", "oomguard.c", "oomguard.x"}
    got = _imported(tree, "oomguard.x", False, known)
    assert got == {"oomguard", "oomguard.a", "oomguard.b", "oomguard.c"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_covers_the_package():
    assert roots(), f"no folder of oomguard under {ROOT}"
    assert len(GRAPH) > 100
    assert "oomguard.lab.demo" in GRAPH["oomguard.cli"]


def test_no_import_circle():
    found = cycles(GRAPH)
    message = "\n".join(
        f"import circle of {len(c)} modules: {' -> '.join(_circle(GRAPH, c))}" for c in found
    )
    assert not found, message


def test_the_twin_imports_no_lab_module():
    bad = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name.startswith("oomguard.twin")
        for target in targets
        if target.startswith("oomguard.lab")
    )
    assert not bad, "\n".join(bad)


def test_only_the_lab_and_the_cli_import_the_lab():
    bad = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if not name.startswith("oomguard.lab") and name not in LAB_USERS
        for target in targets
        if target.startswith("oomguard.lab")
    )
    assert not bad, "\n".join(bad)


def test_the_core_imports_no_component_but_the_listed():
    bad = []
    for name, targets in sorted(GRAPH.items()):
        if _component(name) is not None:
            continue
        allowed = CORE_ALLOWED.get(name, (set(), ""))[0]
        for target in sorted(targets):
            component = _component(target)
            if component is None or component in FOUNDATION:
                continue
            if "*" not in allowed and component not in allowed:
                bad.append(f"{name} (core) imports {target} (component {component})")
    assert not bad, "\n".join(bad)


def test_the_foundation_imports_no_component():
    bad = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if _component(name) in FOUNDATION
        for target in targets
        if _component(target) not in (None, _component(name))
    )
    assert not bad, "\n".join(bad)


def test_the_allowlist_is_still_needed():
    """An allowance nobody uses any more goes: the list stays the short truth. (An entry for a
    module or component this checkout does not have is left alone: branches merge in turn.)"""
    components = {_component(name) for name in GRAPH} - {None}
    for name, (allowed, _why) in CORE_ALLOWED.items():
        if name not in GRAPH:
            continue
        used = {_component(t) for t in GRAPH[name]} - {None}
        unused = (allowed & components) - used
        assert not unused, f"{name} no longer imports {sorted(unused)}: drop it from CORE_ALLOWED"
