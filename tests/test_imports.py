"""The package's import graph, read from the source (AST), not by importing it.

* The product (``vllm_draft_offload/`` outside ``bench/``) never imports the toolkit
  (``vllm_draft_offload.bench``): a serving engine must not load benchmark code.
* No import cycle among the product's modules, counting every import: top-level,
  inside functions and under ``TYPE_CHECKING``.
* The toolkit imports its own modules by package path: no ``sys.path`` edits and no
  underscore-private modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = "vllm_draft_offload"
ROOT = Path(__file__).resolve().parents[1] / PKG
TOOLKIT = f"{PKG}.bench"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Absolute names of every module ``path`` imports (``from a import b``: a and a.b)."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def _files(*, toolkit: bool) -> list[Path]:
    bench = ROOT / "bench"
    return sorted(p for p in ROOT.rglob("*.py") if (bench in p.parents) == toolkit)


def test_product_never_imports_the_toolkit() -> None:
    offenders = {
        _module_name(p): sorted(
            n for n in _imports(p) if n == TOOLKIT or n.startswith(TOOLKIT + ".")
        )
        for p in _files(toolkit=False)
    }
    assert {m: n for m, n in offenders.items() if n} == {}


def test_scan_sees_relative_and_nested_imports(tmp_path: Path) -> None:
    """The scanner itself: a relative import and one inside a function are both found."""
    fake = tmp_path / "probe.py"
    fake.write_text("def f():\n    from .bench import cli\n    import vllm_draft_offload.x\n")
    found = _imports(fake, f"{PKG}.probe")
    assert {f"{PKG}.bench.cli", f"{PKG}.x"} <= found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_product_has_no_import_cycle() -> None:
    files = _files(toolkit=False)
    modules = {_module_name(p) for p in files} - {PKG}  # the bare package imports nothing
    graph = {_module_name(p): _imports(p) & modules for p in files if _module_name(p) in modules}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_toolkit_imports_by_package_path_only() -> None:
    for path in _files(toolkit=True):
        text = path.read_text()
        assert "sys.path" not in text, path
        private = sorted(
            n
            for n in _imports(path)
            if n.startswith(TOOLKIT)
            and any(part.startswith("_") for part in n.split(".")[2:])
            and not n.endswith("__main__")
        )
        assert private == [], (path, private)
