"""The fenced code blocks of README.md and docs/*.md, and the marker before each (the rule is in
test_docs_snippets.py)."""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh", "console": "sh"}
MARKER = re.compile(r"^\s*<!--\s*(fragment|tested-[\w-]+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass
class Block:
    path: Path
    line: int            # of the opening fence, 1-based
    language: str        # "python", "sh", or "" for data, pictures, output
    marker: str | None   # "fragment", "tested-...", or None
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, tag = m.group(1), m.group(2), m.group(3).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        found.append(Block(path, start + 1, CODE.get(tag, ""), marker.group(1) if marker else None,
                           textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [b for path in documents() for b in blocks(path)]
