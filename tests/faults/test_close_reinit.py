"""Group.close() / adapter.shutdown() then init(): a new group with a fresh identity, 20 times in
one process, with no fd or thread left behind. One rank closes late in odd cycles, so the other's
new ring reaches the late rank's old listener first (a stale incarnation must not be taken)."""
from __future__ import annotations

import pytest
from cluster import finish_all, reports, start, stop_all

BODY = """
import threading
import adapter

def counts():
    return len(os.listdir("/proc/self/fd")), threading.active_count()

old = adapter.init(backend=BACKEND)
adapter.shutdown()
try:
    adapter.all_sum(np.ones(4, np.float32), group=old)
    say("OLDWORKS")
except adapter.DistributedError as e:
    say("OLDCLOSED", one_line(e))
base = None
for cycle in range(20):
    g = adapter.init(strict=True, backend=BACKEND)
    assert g is not old, "init() returned the closed group"
    x = adapter.all_sum(np.full(1000, cycle + 1, np.float32), group=g)
    assert x[0] == (cycle + 1) * n, (cycle, x[0])
    if r == 0:
        adapter.send(np.arange(10, dtype=np.int64), 1, group=g)
    elif r == 1:
        assert adapter.recv((10,), np.int64, 0, group=g).tolist() == list(range(10))
    if cycle % 2 and r == 1:
        time.sleep(0.3)  # the other rank forms its next ring before this one closes
    if cycle % 3 == 0:
        g.close()
    else:
        adapter.shutdown()
    old = g
    if cycle == 0:
        base = counts()
say("COUNTS", *base, *counts())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_twenty_close_init_cycles_leave_nothing_behind(tmp_path, backend):
    procs = start(backend, 2, BODY, tmp_path)
    try:
        closed = [" ".join(p.wait_line("OLDCLOSED", 30)[2:]) for p in procs]
        counts = [[int(v) for v in p.wait_line("COUNTS", 90)[2:]] for p in procs]
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert codes == [0, 0], reports(procs)
    assert all("closed" in text for text in closed), closed
    for fd0, thr0, fd1, thr1 in counts:
        assert fd1 <= fd0 and thr1 <= thr0, f"fds {fd0} -> {fd1}, threads {thr0} -> {thr1}"


@pytest.mark.timeout(120)
def test_mpi_close_init_cycles_leave_nothing_behind():
    """MPI allows it because shutdown() frees the duplicated communicator but never finalizes MPI
    (MPI cannot be initialized again after MPI_Finalize)."""
    import os
    import shutil
    import subprocess
    import sys

    from cluster import RANK_SCRIPT, ROOT, base_env

    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable))
    if mpirun is None:
        pytest.skip("no mpirun beside the venv's python")
    env = base_env(FAULT_BACKEND="mpi", FAULT_BODY=BODY, OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
                   OMPI_MCA_btl="self,sm,tcp")
    done = subprocess.run([mpirun, "--oversubscribe", "-n", "2", sys.executable, str(RANK_SCRIPT)],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert sum(1 for f in lines if f[:1] == ["OLDCLOSED"]) == 2, done.stdout
    counts = [[int(v) for v in f[3:]] for f in lines if f[:1] == ["COUNTS"]]
    assert len(counts) == 2, done.stdout
    for fd0, thr0, fd1, thr1 in counts:
        assert fd1 <= fd0 and thr1 <= thr0, f"fds {fd0} -> {fd1}, threads {thr0} -> {thr1}"
