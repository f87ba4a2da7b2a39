"""Start N real rank processes on 127.0.0.1 with the MLX environment contract (no launcher)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from adapter.bench import free_ports  # noqa: F401  (re-exported for the tests)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def ring_hostfile(n: int, connections: int = 1, directory: str | None = None) -> str:
    """A MLX_HOSTFILE for n local ranks with `connections` addresses each; returns its path."""
    ports = iter(free_ports(n * connections))
    data = [[f"127.0.0.1:{next(ports)}" for _ in range(connections)] for _ in range(n)]
    fd, path = tempfile.mkstemp(suffix=".json", prefix="ring-", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    return path


@dataclass
class Rank:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def spawn(n: int, script: str, args: list[str] | None = None, env: dict | None = None,
          connections: int = 1, hostfile: str | None = None, ranks: list[int] | None = None) -> list[subprocess.Popen]:
    hostfile = hostfile or ring_hostfile(n, connections)
    base = dict(os.environ, MLX_HOSTFILE=hostfile, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    base.update(env or {})
    path = script if os.path.isabs(script) else os.path.join(HERE, script)
    return [subprocess.Popen([sys.executable, path] + (args or []), env=dict(base, MLX_RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in (range(n) if ranks is None else ranks)]


def collect(procs: list[subprocess.Popen], timeout: float = 60) -> list[Rank]:
    results = []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += f"\n[test harness] rank process {i} killed after {timeout} s"
            results.append(Rank(i, -9, out, err))
            continue
        results.append(Rank(i, p.returncode, out, err))
    return results


def run(n: int, script: str, args: list[str] | None = None, timeout: float = 60, **kwargs) -> list[Rank]:
    return collect(spawn(n, script, args, **kwargs), timeout)


def assert_all_ok(results: list[Rank]) -> None:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exited {r.returncode}\n{r.stdout}\n{r.stderr}" for r in bad)


def run_checks(checks: dict, out_dir: str) -> None:
    """Worker side of a check registry: run every check on this rank (each gets {"rank", "size"})
    and write {name: "ok" or the traceback} to out_dir/rank<N>.json, so one launch serves many tests."""
    import traceback

    import adapter

    group = adapter.init(strict=True)
    ctx = {"rank": group.rank(), "size": group.size()}
    results = {}
    for name, fn in checks.items():
        try:
            fn(ctx)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{ctx['rank']}.json"), "w") as f:
        json.dump(results, f)
