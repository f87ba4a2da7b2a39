"""Imports point down the layers of docs/architecture.md: the table there is read, every module of
adapter/, launcher/ and jacklring_shared/ is parsed, and an import of a higher layer fails the test. Imports inside
functions count; imports under `if TYPE_CHECKING:` (type names only, never run) do not. Within a layer
(inside a package, too) no modules import each other in a circle."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOUNDATION = "foundation"
TOP_PACKAGES = ("adapter", "launcher", "jacklring_shared")


def layer_table() -> list[tuple[str, list[str]]]:
    """(layer, module prefixes), top layer first, from the table in docs/architecture.md."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("<!-- layers:"):]
    rows = []
    for line in table.splitlines()[3:]:
        if not line.startswith("|"):
            break
        name, modules = (cell.strip() for cell in line.strip("|").split("|")[:2])
        rows.append((name, re.findall(r"`([\w.]+)`", modules)))
    return rows


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes inside `if TYPE_CHECKING:` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def imports(path: Path, name: str | None = None) -> list[tuple[str, int]]:
    """(imported module or module.name, line) for every project import of the file (module
    `name`, by default the one its path in the repository says)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module:
                found.append((target, node.lineno))
            else:  # `from . import x`: x is a module of that package
                found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return [(t, line) for t, line in found if t.split(".")[0] in TOP_PACKAGES]


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> tuple[int, str] | None:
    """(height, layer name) of the longest matching prefix; the top layer is the highest."""
    best = None
    for index, (name, prefixes) in enumerate(table):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), len(table) - index, name)
    return None if best is None else (best[1], best[2])


def test_the_table_names_every_module() -> None:
    table = layer_table()
    assert {name for name, _ in table} >= {"api", "backends", "transport", FOUNDATION, "launcher"}
    unplaced = [module_name(p) for p in _sources() if layer_of(module_name(p), table) is None]
    assert not unplaced, f"modules in no layer of docs/architecture.md: {unplaced}"


def test_no_import_runs_upward() -> None:
    table = layer_table()
    upward = []
    for path in _sources():
        source = module_name(path)
        height, layer = layer_of(source, table)
        for target, line in imports(path):
            placed = layer_of(target, table)
            if placed is None:
                continue
            if layer == "launcher":
                allowed = placed[1] in ("launcher", FOUNDATION)
            else:
                allowed = placed[1] != "launcher" and placed[0] <= height
            if not allowed:
                upward.append(f"{path.relative_to(REPO)}:{line}: {source} ({layer}) imports {target} ({placed[1]})")
    assert not upward, "imports against docs/architecture.md's layers:\n" + "\n".join(upward)


def test_the_walk_sees_upward_imports_and_skips_type_only_ones(tmp_path: Path) -> None:
    """The check itself can fail: a transport module that imports a backend, at the top or in a
    function, is found; the same import under TYPE_CHECKING is not."""
    table = layer_table()
    source = tmp_path / "tcp.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "from ..ring import backend\n"
                      "def later():\n    from ...ops import all_sum\n"
                      "if TYPE_CHECKING:\n    from ..jaccl.backend import JacclBackend\n")
    found = imports(source, "adapter.backends.transport.tcp")
    assert [t for t, _ in found] == ["adapter.backends.ring", "adapter.ops"]
    height = layer_of("adapter.backends.transport.tcp", table)[0]
    assert all(layer_of(t, table)[0] > height for t, _ in found)


def import_graph(sources: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the project modules it imports}, `from pkg import name` counting as an import of
    pkg.name when that is a module (else of pkg itself), a module's imports of itself left out."""
    graph = {}
    for name, path in sources.items():
        targets = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in sources)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    inner = f"{target}.{alias.name}"
                    if inner in sources:
                        targets.add(inner)
                    elif target in sources:
                        targets.add(target)
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: every strongly connected group of two or more modules (Tarjan's
    algorithm, iterative), each sorted."""
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    """A circle (a.py imports b.py, which imports a.py, at the top or in a function) means neither
    module can be read, tested or loaded without the other: pass what is needed in instead (a
    constructor, a callable) or move the shared names down to a module both import."""
    graph = import_graph({module_name(p): p for p in _sources()})
    found = circles(graph)
    text = ["  " + " <-> ".join(group) + ": " + "; ".join(
        f"{a} imports {', '.join(sorted(graph[a] & set(group)))}" for a in group) for group in found]
    assert not found, "import circles:\n" + "\n".join(text)


def test_the_circle_check_sees_a_circle_inside_a_package(tmp_path: Path) -> None:
    """The check itself can fail: two modules of one package that import each other (one of them
    inside a function) are found; the same import under TYPE_CHECKING is no circle."""
    package = tmp_path / "adapter" / "backends" / "ring"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "backend.py").write_text("from . import grow\nfrom .shrink import shrink_ring\n")
    (package / "grow.py").write_text("def grow_ring():\n    from .backend import RingBackend\n")
    (package / "shrink.py").write_text("from typing import TYPE_CHECKING\n"
                                       "if TYPE_CHECKING:\n    from .backend import RingBackend\n")
    prefix = "adapter.backends.ring"
    sources = {f"{prefix}.{p.stem}" if p.stem != "__init__" else prefix: p for p in package.glob("*.py")}
    graph = import_graph(sources)
    assert graph[f"{prefix}.backend"] == {f"{prefix}.grow", f"{prefix}.shrink"}
    assert circles(graph) == [[f"{prefix}.backend", f"{prefix}.grow"]]


def _sources() -> list[Path]:
    return sorted(p for top in TOP_PACKAGES for p in (REPO / top).rglob("*.py"))
