"""Helpers of the security tests (a unique module name: tests/launcher has a conftest too)."""
from __future__ import annotations

import subprocess


def wait_ready(proc: subprocess.Popen, tag: str = "READY", timeout: float = 15) -> None:
    import select
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    assert line.startswith(tag), (f"outsider did not start: {line!r} "
                                  f"{proc.stderr.read() if proc.poll() is not None else ''}")
