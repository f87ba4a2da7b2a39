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
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zygote
from ranks import free_ports  # noqa: E402  (tests/ is on sys.path, see conftest.py)

from jacklring_shared.secret_text import drawn_secret_text

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


# How most users start (no secret: the key comes from the host's 0600 file), and a passphrase
# (stretched): the outsiders of the security tests know neither.
SECRETS = {"no-secret": {}, "passphrase": {"JACKLRING_SECRET": "velvet-quarry-lantern-mosaic-thimble-orchard-gazebo"}}


def rank_envs(backend: str, n: int, tmp: Path, hosts: list[str] | None = None) -> list[dict[str, str]]:
    """The per-rank contract variables for `backend` (hosts[r]: the address rank r uses)."""
    hosts = hosts or ["127.0.0.1"] * n
    # A group that spans hosts needs a job secret (ring/addresses.refuse_open_hosts,
    # jaccl/open_hosts.py), as the launcher would hand out.
    secret = {"JACKLRING_SECRET": drawn_secret_text()} if len(set(hosts)) > 1 else {}
    if backend == "ring":
        ports = free_ports(n) if hosts == ["127.0.0.1"] * n else [41000 + r for r in range(n)]
        hostfile = tmp / "ring-hosts.json"
        hostfile.write_text(json.dumps([[f"{hosts[r]}:{ports[r]}"] for r in range(n)]))
        return [{"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), **secret} for r in range(n)]
    if backend == "jaccl":
        devices = tmp / "jaccl-devices.json"
        devices.write_text(json.dumps(mesh_matrix(n)))
        port = free_ports(1)[0] if hosts[0] == "127.0.0.1" else 41100
        # The ranks share a host: JACKLRING_LOCAL_TRANSPORT=tcp keeps the collectives on the TCP
        # mesh these faults are aimed at (a test of JACCL over shared memory passes auto).
        return [{"MLX_RANK": str(r), "MLX_IBV_DEVICES": str(devices), "JACKLRING_JACCL_TRANSPORT": "tcp",
                 "JACKLRING_LOCAL_TRANSPORT": "tcp", "MLX_JACCL_COORDINATOR": f"{hosts[0]}:{port}", **secret}
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
        # Unprefixed ranks fork from the zygote (tests/zygote.py): importing torch (torch ranks,
        # "any" ranks under torch's variables) or numpy is most of a rank's start, and no fault
        # test is about a fresh interpreter. A prefix (netns, setpriv, unshare) needs a real exec.
        start_rank = zygote.popen if not prefix else subprocess.Popen
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
from adapter.backends.elastic import shrinking
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


# Group.grow()'s scenario (test_grow.py, test_jaccl_grow.py): a member shrinks after the death of
# a rank, then grows back; a newcomer (JACKLRING_JOIN=1) gets the grown group from init(). Then
# every rank checks an all_gather of the slots (MLX_RANK: the ranks of the job's first group) and
# an all_sum of (slot + 1) over the whole group.
GROW_BACK = """
import adapter
slot = int(os.environ["MLX_RANK"])
if os.environ.get("JACKLRING_JOIN") != "1":
    x = np.full(4096, float(slot + 1), np.float32)
    all_sum(x)
    say("READY")
    try:
        while True:
            all_sum(x)
    except ERRORS as e:
        say("ERR", type(e).__name__)
    group = group.shrink(timeout=3)
    say("SHRUNK", group.rank(), group.size())
    shrunk = group
    while os.environ.get("FAULT_GO") and not os.path.exists(os.environ["FAULT_GO"]):
        time.sleep(0.02)  # until the harness says the process at the vacant slot listens
    try:
        group = group.grow(timeout={grow_timeout})
        try:
            all_sum(x, group=shrunk)
        except ERRORS as e:
            say("OLD", type(e).__name__, str(e).replace("\\n", " "))
    except ERRORS as e:
        say("GROWERR", type(e).__name__, str(e).replace("\\n", " "))
        y = all_sum(np.full(16, float(slot + 1), np.float32))  # the shrunk group still works
        say("AFTER", group.rank(), group.size(), float(y[0]))
        sys.exit(0)
say("GROWN", group.rank(), group.size())
slots = all_gather(np.array([slot], np.int64))
y = all_sum(np.full(4096, float(slot + 1), np.float32))
expected = float(sum(int(s) + 1 for s in slots))
say("SUM", group.rank(), group.size(), ",".join(str(int(s)) for s in slots), float(y[0]), expected,
    bool(np.all(y == expected)))
barrier()
"""


def grow_back(grow_timeout: float = 10.0) -> str:
    return GROW_BACK.format(grow_timeout=grow_timeout)


ATTACK = textwrap.dedent("""
    # An outsider with the standard library only (run as another user, e.g. uid 65534): listens
    # at a job's address (argv: host, port, seconds) and answers whoever connects with what it
    # can (it has no job key), noting what it saw.
    import os, socket, sys, time
    host, port = sys.argv[1], int(sys.argv[2])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(16); s.settimeout(0.2)
    print("LISTENING", flush=True)
    end = time.monotonic() + float(sys.argv[3])
    seen = 0
    while time.monotonic() < end:
        try:
            c, _ = s.accept()
        except socket.timeout:
            continue
        seen += 1
        c.settimeout(0.5)
        try:
            hello = c.recv(200)
            # the handshake's own frames: a challenge (magic, OK, a nonce), then, after the
            # connector's proof, an acknowledgement whose MAC it can only guess
            c.sendall(b"JKLC" + bytes([0]) + os.urandom(32))
            c.recv(200)
            c.sendall(b"JKLA" + bytes([0]) + os.urandom(32))
            c.recv(200)
        except OSError:
            pass
        c.close()
    print("SEEN", seen, flush=True)
""")


# Group.grow() again and again (test_grow.py, test_jaccl_grow.py): every rank (members and
# newcomers alike) loops all_max(stop flag) + all_sum until the harness creates the stop file; on
# a failure the members shrink and grow back.
AGAIN_AND_AGAIN = """
import adapter
slot = int(os.environ["MLX_RANK"])
STOP = {stop!r}

def slots_of():
    return [int(s) for s in all_gather(np.array([slot], np.int64))]

def grown(g):
    s = slots_of()
    say("GROWN", g.rank(), g.size(), ",".join(map(str, s)))
    return float(sum(q + 1 for q in s))

expected = grown(group) if os.environ.get("JACKLRING_JOIN") == "1" else float(sum(range(1, n + 1)))
say("READY")
while True:
    try:
        stop = all_max(np.array([1.0 if os.path.exists(STOP) else 0.0]))[0]
        y = all_sum(np.full(64, float(slot + 1), np.float32))
        if not np.all(y == expected):
            say("BAD", float(y[0]), expected)
        if stop:
            break
        time.sleep(0.01)
    except ERRORS as e:
        group = group.shrink(timeout=3)
        say("SHRUNK", group.rank(), group.size())
        group = group.grow(timeout=15)
        expected = grown(group)
say("END", group.rank(), group.size(), ",".join(map(str, slots_of())), float(y[0]))
"""


def again_and_again(stop: Path) -> str:
    return AGAIN_AND_AGAIN.format(stop=str(stop))
