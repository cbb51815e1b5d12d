"""The house rules of the layout, read from the source: no import cycle, and every import arrow
points down (launch, tools and bench above the roles; the roles replay, actors and learner side
by side, meeting only through the core; the core, asyncrl/, below them all).

Every import counts, at the top of a module or inside a function: a lazy import is still an
arrow a reader has to follow. Imports under `if TYPE_CHECKING:` (annotations only) count for
the arrows and are listed apart for cycles: the ones that remain are `TYPE_ONLY_CYCLES` (the
hub handing its whole self to its membership and observer), and no new one may appear. The `asyncrl` command's table (asyncrl/cli.py) names its
subcommands' modules as strings, so it is no arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "replay", "actors", "learner", "launch", "tools", "bench")
ROLES = ("replay", "actors", "learner")
MAY_IMPORT = {
    "asyncrl": {"asyncrl"},
    "replay": {"asyncrl", "replay"},
    "actors": {"asyncrl", "actors"},
    "learner": {"asyncrl", "learner"},
    "launch": {"asyncrl", "launch", *ROLES},
    "tools": {"asyncrl", "tools", "launch", *ROLES},
    "bench": {"asyncrl", "bench", "launch", *ROLES},
}


TYPE_ONLY_CYCLES: list[list[str]] = []


def modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def type_checking_nodes(tree: ast.Module) -> set[int]:
    """The ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def imports(name: str, path: Path, known: dict[str, Path], *, annotations: bool = True) -> set[str]:
    """The project modules `name` imports, anywhere in its body (without those under
    `if TYPE_CHECKING:` when `annotations` is False)."""

    def resolve(dotted: str) -> str | None:
        while dotted:
            if dotted in known:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set() if annotations else type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            # `from pkg import mod` names the module; `from mod import name` the module
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            found = resolve(target)
            if found is not None and found != name:
                out.add(found)
    return out


def graph(*, annotations: bool = True) -> dict[str, set[str]]:
    known = modules()
    return {
        name: imports(name, path, known, annotations=annotations) for name, path in known.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert cycles(edges) == [["a.x", "a.y", "a.z"]]
    assert cycles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_no_import_cycles() -> None:
    found = cycles(graph(annotations=False))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_only_the_known_annotation_cycles_remain() -> None:
    found = sorted(cycles(graph()))
    assert found == TYPE_ONLY_CYCLES, "cycles through annotations: " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_every_arrow_points_down() -> None:
    wrong = [
        f"{name} -> {target}"
        for name, targets in sorted(graph().items())
        for target in sorted(targets)
        if target.split(".")[0] not in MAY_IMPORT[name.split(".")[0]]
    ]
    assert wrong == [], "imports against the layout: " + ", ".join(wrong)


def test_the_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The reader finds imports inside functions too (the arrows the rules are about)."""
    known = modules()
    edges = graph()
    assert "asyncrl.protocol.messages" in edges["asyncrl.protocol.codec"]
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from learner import loop\n"
        "def f() -> None:\n    from replay import server\n"
    )
    assert imports("asyncrl.probe", source, known) == {"replay.server", "learner.loop"}
    assert imports("asyncrl.probe", source, known, annotations=False) == {"replay.server"}
