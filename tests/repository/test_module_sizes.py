"""No Python module of the library is over 500 lines (one job per module): a module that grows past
it is split by job. The modules below are over it today and are being split by the issue named
beside them; each may not grow past its size here, and its entry goes once it is split (an
entry for a module that no longer exists checks nothing, so that a lane's split merges cleanly)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT = 500
PACKAGES = ("adapter", "launcher", "jacklring_shared")

# module -> (lines it may have until it is split, the issue splitting it)
BEING_SPLIT = {
    "adapter/torch_backend/work.py": (736, "#43"),
    "adapter/torch_backend/process_group.py": (630, "#43"),
    "adapter/backends/transport/handshake.py": (631, "#44"),
    "adapter/backends/local/shm.py": (501, "#42"),
}


def line_counts() -> dict[str, int]:
    return {str(p.relative_to(REPO)): len(p.read_text().splitlines())
            for top in PACKAGES for p in sorted((REPO / top).rglob("*.py"))}


def oversized(counts: dict[str, int]) -> list[str]:
    found = []
    for module, lines in counts.items():
        allowed, issue = BEING_SPLIT.get(module, (LIMIT, None))
        if lines > allowed:
            why = f"over {LIMIT} lines" if issue is None else f"over its {allowed} lines while {issue} splits it"
            found.append(f"{module}: {lines} lines, {why}")
    return found


def test_no_module_is_over_the_limit() -> None:
    found = oversized(line_counts())
    assert not found, "modules with several jobs (split them by job):\n" + "\n".join(found)


def test_the_check_finds_a_long_module() -> None:
    """The check itself can fail: a new module of 501 lines, and a listed one that grew."""
    assert oversized({"adapter/new.py": LIMIT + 1, "adapter/ok.py": LIMIT}) == [
        f"adapter/new.py: {LIMIT + 1} lines, over {LIMIT} lines"]
    assert len(oversized({"adapter/torch_backend/work.py": 737})) == 1
