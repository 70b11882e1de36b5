"""The package's import graph, read from the source (lazy imports inside functions count):
no cycle anywhere, distributed.py a leaf, the runner below the executor."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanokv"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the nanokv modules it imports (a name imported from a package counts as
    the submodule when there is one)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "nanokv"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                if base.split(".")[0] == "nanokv":
                    deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the path of modules around it, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (cycle := visit(mod)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_layering():
    graph = import_graph()
    assert graph["nanokv.distributed"] == set()  # a torch.distributed leaf
    runner = {m for m in graph if m.startswith("nanokv.runner")}
    below_runner = set().union(*(graph[m] for m in runner))
    assert not any(m.startswith(("nanokv.executor", "nanokv.llm")) for m in below_runner)
    for leaf in ("nanokv.sampling_params", "nanokv.outputs"):
        assert graph[leaf] == set()
