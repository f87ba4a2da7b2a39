"""The one harness that starts rank processes for the tests, two ways:

- launch(): the real launcher (`python -m launcher.cli`), as a user starts a job: every
  backend, hostfiles, the launcher's own environment. Use this unless the test is about the
  raw environment a backend reads.
- spawn()/run(): N processes on 127.0.0.1 with the MLX environment contract set by hand
  (MLX_RANK, MLX_HOSTFILE), for ring tests that need a hostfile the launcher would never
  write (duplicate addresses, IPv6, many addresses per rank, per-rank settings).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import zygote

from adapter.bench import free_ports  # noqa: F401  (re-exported for the tests)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCHER = [sys.executable, "-m", "launcher.cli"]
INHERITED_PREFIXES = ("MLX_", "JACKLRING_", "NCCL_", "OMPI_", "PMIX_", "PMI_", "PRTE_")
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    # Only the transports one machine needs: probing ofi/uct costs about a second per launch.
    "OMPI_MCA_btl": "self,sm,tcp",
    # Ranks waiting in MPI yield the CPU: with more ranks than cores, busy polling made each
    # MPI call wait for a scheduler time slice (tens of ms).
    "OMPI_MCA_mpi_yield_when_idle": "1",
}


def launch_env(**extra: str) -> dict[str, str]:
    """This environment without inherited backend settings, Open MPI set up for root on
    loopback, and deadlines short enough that a stuck rank fails a test instead of hanging it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_PREFIXES) and k != "MPI_LOCALNRANKS"}
    env.update(MPI_ENV)
    env.update(JACKLRING_TIMEOUT="30", JACKLRING_CONNECT_TIMEOUT="30", PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def launch(args: Sequence[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`launcher *args` from the repository root, output captured. Past timeout the launcher
    gets SIGTERM (it stops its ranks and says which were running), then SIGKILL (its ranks die
    with it), and subprocess.TimeoutExpired is raised with the output so far."""
    proc = subprocess.Popen([*LAUNCHER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launch_env(**(env or {})), cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rank_lines(result: subprocess.CompletedProcess, marker: str) -> list[str]:
    """The launcher's '[rank] ...' output lines containing marker, without the prefix, sorted."""
    return sorted(line.split("] ", 1)[1] for line in result.stdout.splitlines() if "] " in line and marker in line)


def local_hostfile(path: Path, backend: str, ranks: int, rdma: list[list[str | None]] | None = None,
                   ips: Sequence[str] = ("127.0.0.1",)) -> Path:
    """A launcher hostfile of `ranks` hosts on this machine (ssh is never used for 127.0.0.1)."""
    hosts: list[dict] = [{"ssh": "127.0.0.1", "ips": list(ips)} for _ in range(ranks)]
    for host, row in zip(hosts, rdma or []):
        host["rdma"] = row
    path.write_text(json.dumps({"backend": backend, "hosts": hosts}))
    return path


def output_tail(result: subprocess.CompletedProcess, chars: int = 3000) -> str:
    return (f"--- launcher exit {result.returncode}\n--- stdout\n{result.stdout[-chars:]}\n"
            f"--- stderr\n{result.stderr[-chars:]}")


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


# A process started under this prefix is, for shared memory, on another host: the same kernel,
# but in a pid namespace of its own, where this host's pids mean nothing.
ANOTHER_HOST = ["unshare", "--pid", "--fork", "--kill-child"]


def jaccl_env(n: int, directory: str | None = None) -> dict[str, str]:
    """What makes spawn() start JACCL ranks instead (init tries JACCL before the ring): a
    coordinator on this host and a device file whose devices do not exist, so the ranks form
    JACCL's TCP mesh."""
    fd, devices = tempfile.mkstemp(suffix=".json", prefix="jaccl-devices-", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump([[None if i == j else f"rdma_en{j + 2}" for j in range(n)] for i in range(n)], f)
    return {"MLX_JACCL_COORDINATOR": f"127.0.0.1:{free_ports(1)[0]}", "MLX_IBV_DEVICES": devices,
            "JACKLRING_JACCL_TRANSPORT": "tcp"}


def spawn(n: int, script: str, args: list[str] | None = None, env: dict | None = None,
          connections: int = 1, hostfile: str | None = None, ranks: list[int] | None = None,
          wraps: dict[int, list[str]] | None = None, fresh: bool = False) -> list[subprocess.Popen]:
    """Start ranks (all n, or those listed) of a local ring; wraps[r] prefixes rank r's command.
    Unwrapped ranks fork from the zygote (tests/zygote.py: numpy and torch imported once per
    pytest worker); fresh=True starts every rank as a new interpreter, for a test about what
    happens at import."""
    hostfile = hostfile or ring_hostfile(n, connections)
    base = dict(os.environ, MLX_HOSTFILE=hostfile, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    base.update(env or {})
    path = script if os.path.isabs(script) else os.path.join(HERE, script)
    wraps = wraps or {}
    procs = []
    for r in (range(n) if ranks is None else ranks):
        start = subprocess.Popen if fresh or wraps.get(r) else zygote.popen
        procs.append(start(wraps.get(r, []) + [sys.executable, path] + (args or []), env=dict(base, MLX_RANK=str(r)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def collect(procs: list[subprocess.Popen], timeout: float = 60, make: Callable = Rank) -> list:
    """Every process's make(index, exit code, stdout, stderr), in order. When one outlives the
    timeout every process is killed, so a hang fails fast and names the rank that hung."""
    results = []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += f"\n[test harness] rank process {i} killed after {timeout} s"
            results.append(make(i, -9, out, err))
            continue
        results.append(make(i, p.returncode, out, err))
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
