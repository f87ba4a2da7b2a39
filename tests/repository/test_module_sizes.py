"""No Python module of the library is over 500 lines (one job per module): a module that grows past
it is split by job (docs/architecture.md lists the rooms)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT = 500
PACKAGES = ("adapter", "launcher", "jacklring_shared")


def line_counts() -> dict[str, int]:
    return {str(p.relative_to(REPO)): len(p.read_text().splitlines())
            for top in PACKAGES for p in sorted((REPO / top).rglob("*.py"))}


def oversized(counts: dict[str, int]) -> list[str]:
    return [f"{module}: {lines} lines, over {LIMIT}" for module, lines in counts.items() if lines > LIMIT]


def test_no_module_is_over_the_limit() -> None:
    found = oversized(line_counts())
    assert not found, "modules with several jobs (split them by job):\n" + "\n".join(found)


def test_the_check_finds_a_long_module() -> None:
    """The check itself can fail: a module of 501 lines is found, one of 500 is not."""
    assert oversized({"adapter/new.py": LIMIT + 1, "adapter/ok.py": LIMIT}) == [f"adapter/new.py: {LIMIT + 1} lines, over {LIMIT}"]
