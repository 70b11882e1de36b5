"""bench.py is only the entry point: its code lives in benchmarks/, one module per subject,
whose imports (lazy ones inside functions included) form no cycle; nanokv/ never imports
benchmarks/ (the benchmarks depend on the engine, not the other way round)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module path.py imports, anywhere in it (absolute names)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                package = module_name(path).split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
    return out


def benchmarks_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in BENCHMARKS.rglob("*.py")}
    return {mod: {d for d in imported(path) if d in files and d != mod} for mod, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_bench_py_only_calls_benchmarks_cli():
    tree = ast.parse((ROOT / "bench.py").read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined == [], f"bench.py defines {defined}: they belong in benchmarks/"
    assert "benchmarks.cli.main" in imported(ROOT / "bench.py")
    assert ast.get_docstring(tree).count("python bench.py") >= 4  # its usage lines, which --help prints


def test_benchmarks_modules_by_subject_without_import_cycle():
    graph = benchmarks_graph()
    subjects = {"cli", "workloads", "engines", "peers", "peers.ct2", "peers.llamacpp", "peers.llamacpp_batch",
                "throughput", "roofline",
                "report", "accuracy", "micro", "measure", "serve", "structured"}
    assert {f"benchmarks.{s}" for s in subjects} <= set(graph)
    assert find_cycle(graph) is None, find_cycle(graph)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself sees one
    # the peers and the roofline stand alone: what they need is the workloads and the measurements
    # (llama.cpp also its batch-decode driver, which runs in a process of its own)
    alone = {"benchmarks.workloads", "benchmarks.measure"}
    for mod in ("benchmarks.peers.ct2", "benchmarks.roofline"):
        assert graph[mod] <= alone, (mod, graph[mod])
    assert graph["benchmarks.peers.llamacpp"] <= alone | {"benchmarks.peers.llamacpp_batch"}
    # the driver imports neither torch nor nanokv nor the rest of benchmarks/: llama.cpp alone in its process
    driver = imported(BENCHMARKS / "peers" / "llamacpp_batch.py")
    assert not {d.split(".")[0] for d in driver} & {"torch", "nanokv", "benchmarks"}, driver


def test_nanokv_never_imports_benchmarks():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "nanokv").rglob("*.py")
                 if any(m.split(".")[0] in ("benchmarks", "bench") for m in imported(p))]
    assert offenders == []
