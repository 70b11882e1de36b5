"""The package's import graph, read from the source (lazy imports inside functions count):
no cycle anywhere, distributed.py a leaf, the runner below the executor."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanokv"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the nanokv modules it imports. `from P import x` reads P's namespace, so
    it depends on P (P's __init__, which may still be running when a module P imports
    reads it back: the cycle this test exists to catch), and on P.x too when x is a
    submodule; `import P.x` depends on P.x only."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name
    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == top}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                if base.split(".")[0] == top:
                    deps |= {base} | {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files}
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


def test_a_module_reading_its_own_package_is_a_cycle(tmp_path):
    """kernels/__init__ imported ffi, and ffi read `from nanokv.kernels import build` back
    out of the half-initialised package: a cycle, whether or not `build` is a submodule."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.ffi import lib\n")
    (pkg / "build.py").write_text("")
    (pkg / "ffi.py").write_text("from pkg import build\nlib = build\n")
    assert find_cycle(import_graph(pkg)) == ["pkg", "pkg.ffi", "pkg"]
    (pkg / "ffi.py").write_text("import pkg.build as build\nlib = build\n")
    assert find_cycle(import_graph(pkg)) is None


def test_layering():
    graph = import_graph()
    assert graph["nanokv.distributed"] == set()  # a torch.distributed leaf
    runner = {m for m in graph if m.startswith("nanokv.runner")}
    below_runner = set().union(*(graph[m] for m in runner))
    assert not any(m.startswith(("nanokv.executor", "nanokv.llm")) for m in below_runner)
    # leaves: they import nothing of nanokv but the table of unsupported vLLM names, itself a leaf
    assert graph["nanokv.unsupported"] == set()
    for leaf in ("nanokv.sampling_params", "nanokv.outputs", "nanokv.inputs"):
        assert graph[leaf] <= {"nanokv.unsupported"}
    # EngineArgs (torch-free) reads the config module's validation lazily; never the reverse
    assert graph["nanokv.engine.arg_utils"] <= {"nanokv.config"}
    assert "nanokv.engine.arg_utils" not in graph["nanokv.config"]
