"""benchmarks/netns_bench.py at its smallest: 2 ranks in namespaces behind a shaped link, the ring,
one size. It must print a table whose busbw the shaping bounds, and leave no namespace (and so no
veth or qdisc) behind, after a normal run, SIGTERM, or SIGKILL followed by --cleanup."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "netns_bench.py"
SMALLEST = ["-n", "2", "--backend", "ring", "--sizes", "1M", "--rounds", "1", "--iters", "3",
            "--ceiling-seconds", "1", "--rate", "1gbit"]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "tc", "setpriv")),
                       reason="needs ip and tc (iproute2) and setpriv (util-linux)"),
]


def namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"jlnb-{pid}-")]


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.fixture
def start(tmp_path):
    """Start the benchmark (output to a file: ranks that outlive it must not hold the test's
    pipe); afterwards kill what is left of each run and remove its namespaces."""
    procs: list[subprocess.Popen] = []

    def run(*extra: str) -> subprocess.Popen:
        log = open(tmp_path / f"run{len(procs)}.log", "w+")
        proc = subprocess.Popen([sys.executable, str(SCRIPT), *SMALLEST, *extra], cwd=REPO, text=True,
                                stdout=log, stderr=subprocess.STDOUT)
        proc.log = log
        procs.append(proc)
        return proc
    yield run
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.log.close()
        for name in namespaces_of(proc.pid):
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name])


def output(proc: subprocess.Popen, timeout: float) -> str:
    proc.wait(timeout=timeout)
    proc.log.seek(0)
    return proc.log.read()


def wait_for_ranks(proc: subprocess.Popen, timeout: float = 60) -> list[str]:
    """This run's namespaces, once a process runs in the last rank's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, output(proc, 1)
        names = namespaces_of(proc.pid)
        rank1 = f"jlnb-{proc.pid}-r1"
        if rank1 in names and subprocess.run(["ip", "netns", "pids", rank1], capture_output=True,
                                             text=True).stdout.split():
            return names
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no rank started in its namespace within {timeout} s")


@pytest.mark.timeout(120)
def test_smallest_run_prints_a_bounded_table_and_leaves_nothing(start):
    before = root_links()
    proc = start()
    out = output(proc, 100)
    assert proc.returncode == 0, out
    assert re.search(r"^\s+bytes \|\s+ring time\s+algbw\s+busbw\s+link\s+ok$", out, re.M), out
    row = re.search(r"^\s+1M \|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+yes$", out, re.M)
    assert row, out
    link = float(row.group(4))
    # Unshaped veths carry several GB/s: above 1.0 the tbf was not in the path.
    assert 0.2 < link <= 1.0, out
    assert re.search(r"plain TCP ring.*slowest = 0\.\d+ of the link", out), out
    assert namespaces_of(proc.pid) == []
    assert root_links() <= before  # nothing was ever created in this namespace


@pytest.mark.timeout(120)
def test_sigterm_removes_the_namespaces(start):
    proc = start("--ceiling-seconds", "40")
    assert len(wait_for_ranks(proc)) == 3  # the bridge and two ranks
    proc.send_signal(signal.SIGTERM)
    out = output(proc, 60)
    assert proc.returncode != 0, out
    assert namespaces_of(proc.pid) == [], out


@pytest.mark.timeout(120)
def test_after_sigkill_the_ranks_die_and_cleanup_removes_the_rest(start):
    proc = start("--ceiling-seconds", "40")  # ranks that outlived it would run 40 s
    names = wait_for_ranks(proc)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
              for n in names):
        assert time.monotonic() < deadline, "ranks outlived the benchmark (no parent-death signal?)"
        time.sleep(0.1)
    assert sorted(namespaces_of(proc.pid)) == sorted(names)  # what --cleanup is for
    done = subprocess.run([sys.executable, str(SCRIPT), "--cleanup"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(n in done.stdout for n in names), done.stdout
    assert namespaces_of(proc.pid) == []
