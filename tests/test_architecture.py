"""The direction of dependencies (docs/architecture.md), read from the code's own imports:
the top-level packages depend one way, an import across them says where it goes
(`ctxgate.…`), the engine never imports the edge, and no module imports itself in a circle (not even
inside a function or for type checking only: a reader still goes round it)."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "pipeline", "memory", "wal", "redis_backend")
ALLOWED = {"pipeline": set(), "redis_backend": set(), "wal": {"redis_backend"},
           "memory": {"pipeline", "wal", "redis_backend"}, "proxy": {"pipeline", "memory", "wal", "redis_backend"}}
"""What each top-level package may import besides itself: proxy uses the others; they never import proxy."""
EDGE = ("proxy.doors", "proxy.admin", "proxy.replay", "proxy.app", "proxy.cli", "proxy.wal_cli", "proxy.launcher")
"""The edge: what parses and renders wire formats, serves the admin API, runs the CLI."""
INNER = {"proxy.engine": EDGE, "proxy.upstream": (*EDGE, "proxy.engine")}
"""Inside proxy: the engine never imports a door or the admin API; the upstream client neither, nor the engine."""


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    relative_levels: int
    runtime: bool
    """Imported when the module loads (not under TYPE_CHECKING, not inside a function)."""
    line: int


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports() -> list[Import]:
    found = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            me = _module(path)
            package = me if path.name == "__init__.py" else me[:-1]
            found += _read(path, ".".join(me), package)
    return found


def _read(path: Path, me: str, package: list[str]) -> list[Import]:
    out = []
    tree = ast.parse(path.read_text())
    lazy: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            lazy |= {id(n) for n in ast.walk(node) if n is not node}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [".".join([*target, a.name]) for a in node.names]
            elif node.module and node.module.startswith("ctxgate."):
                target = node.module.split(".")[1:]
                names = [".".join([*target, a.name]) for a in node.names]
            else:
                continue
            for name in [".".join(target), *names]:
                out.append(Import(me, name, node.level, id(node) not in lazy, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ctxgate."):
                    out.append(Import(me, alias.name[len("ctxgate."):], 0, id(node) not in lazy, node.lineno))
    return out


def _known(name: str, modules: set[str]) -> str | None:
    """The module `name` is (an imported name resolves to the module that defines it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


IMPORTS = _imports()
MODULES = {imp.source for imp in IMPORTS} | {".".join(_module(p)) for top in PACKAGES
                                             for p in (ROOT / top).rglob("*.py")}


def test_an_import_across_top_level_packages_is_absolute() -> None:
    climbing = [f"{i.source}:{i.line} -> {i.target}" for i in IMPORTS
                if i.relative_levels and i.target.split(".")[0] != i.source.split(".")[0]]
    assert not climbing, "import these as ctxgate.…:\n" + "\n".join(climbing)


def test_the_top_level_packages_depend_one_way() -> None:
    wrong = {f"{i.source} -> {i.target}" for i in IMPORTS
             if (a := i.source.split(".")[0]) != (b := i.target.split(".")[0]) and b not in ALLOWED[a]}
    assert not wrong, "\n".join(sorted(wrong))
    used = {(i.source.split(".")[0], i.target.split(".")[0]) for i in IMPORTS}
    assert {("proxy", "pipeline"), ("proxy", "memory"), ("proxy", "wal"), ("memory", "wal")} <= used


def test_the_engine_and_the_upstream_client_never_import_the_edge() -> None:
    wrong = sorted({f"{i.source}:{i.line} -> {i.target}" for i in IMPORTS if i.runtime
                    for inner, banned in INNER.items()
                    if (i.source == inner or i.source.startswith(inner + "."))
                    and any(i.target == b or i.target.startswith(b + ".") for b in banned)})
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_in_a_circle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        target = _known(i.target, MODULES)
        if target is not None and target != i.source:  # a lazy or type-only import ties two modules too
            graph[i.source].add(target)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            circle = visit(m)
            assert circle is None, " -> ".join(circle)
