"""tests/README.md, the index from modules to the tests that cover them, stays true: every module
of adapter/, launcher/ and jacklring_shared/ is named in a row or lies in a folder a row names
(a new module gets a row, or its folder's), and every path the table names exists (a moved
module or test is moved there too)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("adapter", "launcher", "jacklring_shared")


def index_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(code paths, test paths) of each row of the table under the index marker."""
    table = text[text.index("<!-- index:"):]
    rows = []
    for line in table.splitlines()[3:]:
        if not line.startswith("|"):
            break
        code, tests = (cell.strip() for cell in line.strip("|").split("|")[:2])
        rows.append((re.findall(r"`([^`]+)`", code), re.findall(r"`([^`]+)`", tests)))
    return rows


def uncovered(modules: list[str], rows: list[tuple[list[str], list[str]]]) -> list[str]:
    named = [path for code, _ in rows for path in code]
    return [m for m in modules if not any(m == p or (p.endswith("/") and m.startswith(p)) for p in named)]


def missing_paths(rows: list[tuple[list[str], list[str]]], root: Path) -> list[str]:
    return [p for code, tests in rows for p in code + tests if not (root / p).exists()]


def _modules() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for top in PACKAGES for p in (REPO / top).rglob("*.py"))


def test_every_module_has_tests_in_the_index() -> None:
    rows = index_rows((REPO / "tests" / "README.md").read_text())
    assert rows, "tests/README.md has no index table"
    assert all(tests for _, tests in rows), [code for code, tests in rows if not tests]
    left = uncovered(_modules(), rows)
    assert not left, "modules that tests/README.md does not cover (add a row, or the folder's):\n" + "\n".join(left)


def test_every_path_in_the_index_exists() -> None:
    gone = missing_paths(index_rows((REPO / "tests" / "README.md").read_text()), REPO)
    assert not gone, "paths in tests/README.md that do not exist:\n" + "\n".join(gone)


def test_the_checks_fail_on_a_stale_index(tmp_path: Path) -> None:
    """The checks themselves can fail: a module under no row, and a row naming a test that is gone."""
    text = ("<!-- index: -->\n| code | tests |\n|---|---|\n"
            "| `adapter/ring/` | `tests/ring/test_a.py` |\n| `adapter/ops.py` | `tests/gone.py` |\n")
    rows = index_rows(text)
    assert uncovered(["adapter/ring/x.py", "adapter/ops.py", "adapter/new.py"], rows) == ["adapter/new.py"]
    (tmp_path / "tests" / "ring").mkdir(parents=True)
    (tmp_path / "tests" / "ring" / "test_a.py").write_text("")
    (tmp_path / "adapter" / "ring").mkdir(parents=True)
    (tmp_path / "adapter" / "ops.py").write_text("")
    assert missing_paths(rows, tmp_path) == ["tests/gone.py"]
