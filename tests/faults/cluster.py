"""Start real ring / JACCL / torch ranks for the fault tests, with every wait bounded.

Each rank runs scripts/rank.py, which forms the group named by FAULT_BACKEND and then runs the
Python body in FAULT_BODY. Bodies report with `say("TAG", ...)` lines that carry the rank and
time.monotonic() (CLOCK_MONOTONIC is system-wide on Linux, so the harness can subtract the
moment it killed a rank from the moment a survivor raised).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zygote
from ranks import free_ports  # noqa: E402  (tests/ is on sys.path, see conftest.py)

FAULTS = Path(__file__).resolve().parent
ROOT = FAULTS.parents[1]
RANK_SCRIPT = FAULTS / "scripts" / "rank.py"
BACKENDS = ("ring", "jaccl", "torch")


def base_env(**extra: str) -> dict[str, str]:
    """This environment without anything that would steer backend selection, plus short deadlines."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLX_", "JACKLRING_", "OMPI_", "PMIX_", "MASTER_", "NCCL_", "FAULT_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               JACKLRING_TIMEOUT="30", JACKLRING_CONNECT_TIMEOUT="30")
    env.update(extra)
    return env


def mesh_matrix(n: int) -> list:
    return [[None if i == j else f"rdma_en{j + 2}" for j in range(n)] for i in range(n)]


def rank_envs(backend: str, n: int, tmp: Path, hosts: list[str] | None = None) -> list[dict[str, str]]:
    """The per-rank contract variables for `backend` (hosts[r]: the address rank r uses)."""
    hosts = hosts or ["127.0.0.1"] * n
    if backend == "ring":
        ports = free_ports(n) if hosts == ["127.0.0.1"] * n else [41000 + r for r in range(n)]
        hostfile = tmp / "ring-hosts.json"
        hostfile.write_text(json.dumps([[f"{hosts[r]}:{ports[r]}"] for r in range(n)]))
        return [{"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(n)]
    if backend == "jaccl":
        devices = tmp / "jaccl-devices.json"
        devices.write_text(json.dumps(mesh_matrix(n)))
        port = free_ports(1)[0] if hosts[0] == "127.0.0.1" else 41100
        # The ranks share a host: JACKLRING_LOCAL_TRANSPORT=tcp keeps the collectives on the TCP
        # mesh these faults are aimed at (a test of JACCL over shared memory passes auto).
        return [{"MLX_RANK": str(r), "MLX_IBV_DEVICES": str(devices), "JACKLRING_JACCL_TRANSPORT": "tcp",
                 "JACKLRING_LOCAL_TRANSPORT": "tcp", "MLX_JACCL_COORDINATOR": f"{hosts[0]}:{port}"}
                for r in range(n)]
    if backend == "torch":
        port = free_ports(1)[0]
        return [{"RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                for r in range(n)]
    raise ValueError(backend)


@dataclass
class RankProc:
    """One rank process whose stdout/stderr are read by threads (so waits can time out)."""
    rank: int
    popen: subprocess.Popen | zygote.Process
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    returned: set[int] = field(default_factory=set)
    readers_done: threading.Event = field(default_factory=threading.Event)

    def start_readers(self) -> None:
        def pump(stream, sink, last):
            for line in stream:
                sink.append(line)
            stream.close()
            if last:
                self.readers_done.set()
        # stdout is read last to the end, so readers_done means all stdout lines are in.
        threading.Thread(target=pump, args=(self.popen.stderr, self.err, False), daemon=True).start()
        threading.Thread(target=pump, args=(self.popen.stdout, self.out, True), daemon=True).start()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_line(self, tag: str, timeout: float, rank: int | None = None) -> list[str]:
        """The fields of the first not yet returned stdout line `TAG ...` (from `rank` when
        given, for a launcher's merged output); raises AssertionError at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.popen.poll() is not None
            for index, line in enumerate(list(self.out)):
                parts = line.split()
                if parts and parts[0].startswith("[") and parts[0].endswith("]"):
                    parts = parts[1:]  # the launcher's "[rank] " prefix
                if (index not in self.returned and parts and parts[0] == tag
                        and (rank is None or parts[1:2] == [str(rank)])):
                    self.returned.add(index)
                    return parts[1:]
            if exited and self.readers_done.is_set():
                raise AssertionError(f"rank {self.rank} exited {self.popen.returncode} before printing "
                                     f"{tag!r}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"rank {self.rank} printed no {tag!r} line within {timeout} s\n"
                                     f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")
            time.sleep(0.02)

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Send sig; returns the moment (time.monotonic) it was sent."""
        t = time.monotonic()
        self.popen.send_signal(sig)
        return t

    def finish(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            self.err.append(f"\n[fault harness] rank {self.rank} killed after {timeout} s\n")
            return -9

    def tagged(self, tag: str) -> list[list[str]]:
        return [line.split()[1:] for line in self.out if line.split()[:1] == [tag]]

    def report(self) -> str:
        return (f"--- rank {self.rank} exit {self.popen.returncode}\n{self.stdout[-3000:]}\n"
                f"{self.stderr[-5000:]}")


def start(backend: str, n: int, body: str, tmp: Path, env: dict[str, str] | None = None,
          ranks: list[int] | None = None, envs: list[dict[str, str]] | None = None,
          wrap: list[str] | None = None, wraps: dict[int, list[str]] | None = None) -> list[RankProc]:
    """Start ranks (default all n) of `backend` running `body`. wrap/wraps prefix the command
    (e.g. `ip netns exec NS`) for every rank / for some ranks."""
    envs = envs or rank_envs(backend, n, tmp)
    procs = []
    for r in (range(n) if ranks is None else ranks):
        full_env = base_env(FAULT_BACKEND=backend, FAULT_BODY=body, **envs[r])
        full_env.update(env or {})
        prefix = (wraps or {}).get(r, wrap or [])
        # torch ranks, and "any" ranks under torch's variables (they import torch for its store), fork
        # from the zygote (tests/zygote.py) when not prefixed: importing torch is most of their start
        imports_torch = backend == "torch" or (backend == "any" and "MASTER_ADDR" in envs[r])
        start_rank = zygote.popen if imports_torch and not prefix else subprocess.Popen
        popen = start_rank(prefix + [sys.executable, str(RANK_SCRIPT)], env=full_env, cwd=str(ROOT),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc = RankProc(r, popen)
        proc.start_readers()
        procs.append(proc)
    return procs


def finish_all(procs: list[RankProc], timeout: float) -> list[int]:
    """Wait for every rank (all under one deadline); kill whatever is left."""
    deadline = time.monotonic() + timeout
    codes = [p.finish(max(0.1, deadline - time.monotonic())) for p in procs]
    time.sleep(0.05)  # readers flush the last lines
    return codes


def stop_all(procs: list[RankProc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait()


def reports(procs: list[RankProc]) -> str:
    return "\n".join(p.report() for p in procs)


def seats_close_with(group: str) -> str:
    """Rank-script lines: the seats the group named `group` kept for groups that did not form close
    when it closes, not when the collector runs (it is off here, and every group is still
    referenced): says SEATS <how many were kept> <those still accepting after close(), or ->."""
    return f"""
import gc, socket
from adapter.backends.transport import shrinking
gc.disable()
seats = [s.where() for kept, _ in shrinking._kept.get({group}.backend, []) for s in kept]
{group}.close()
still = []
for address in seats:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        still.append(address)
    except OSError:
        pass
say("SEATS", len(seats), ",".join(still) or "-")
"""
