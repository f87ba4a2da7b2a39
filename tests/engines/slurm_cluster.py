"""A real one-node Slurm (munged, slurmctld, slurmd) on 127.0.0.1 under a temporary config.

No systemd here: the daemons are started by hand in the foreground, each from its own
Popen, and stopped by pid. The node claims more CPUs than the machine has
(SlurmdParameters=config_overrides) so that 3-4 tasks run on 2 cores.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from adapter.bench import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "sinfo")
NODE_CPUS = 4


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None
              and not os.path.exists(f"/usr/sbin/{name}")]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} missing): run scripts/setup.sh "
                "(apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        return "starting slurmd and munged needs root"
    if not os.path.exists("/etc/munge/munge.key"):
        return "munge has no key (/etc/munge/munge.key): reinstall munge"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname()
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self, deadline_s: float = 30) -> None:
        munge = self.root / "munge"
        for sub in ("munge", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(munge, 0o755)  # munged refuses a socket folder others may write to
        key = munge / "munge.key"
        shutil.copyfile("/etc/munge/munge.key", key)
        os.chmod(key, 0o600)
        socket_path = munge / "munge.socket"
        self._spawn("munged", [_daemon("munged"), "--foreground", "--force", f"--socket={socket_path}",
                               f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                               f"--seed-file={munge / 'munged.seed'}", f"--log-file={munge / 'munged.log'}"])
        self._wait_for(lambda: socket_path.exists(), "munged's socket", deadline_s)
        ctld_port, slurmd_port = free_ports(2)
        self.conf.write_text(self._config(socket_path, ctld_port, slurmd_port))
        self._spawn("slurmctld", [_daemon("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_daemon("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait_for(self._node_idle, f"node {self.node} to be idle in sinfo", deadline_s)

    def _config(self, munge_socket: Path, ctld_port: int, slurmd_port: int) -> str:
        r = self.root
        return "\n".join([
            "ClusterName=jacklringtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",  # no cgroups in a container
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin", "MpiDefault=none", "ReturnToService=2",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "PlugStackConfig=/dev/null",
            "SlurmdParameters=config_overrides",  # the node may claim more CPUs than it has
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ])

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=dict(os.environ, SLURM_CONF=str(self.conf)))
        log.close()

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10,
                             env=dict(os.environ, **self.env))
        return out.stdout.strip() == "idle"

    def _wait_for(self, ready, what: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {deadline_s} s waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL after 5 s; slurmd first so no task outlives the test."""
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

