"""A stalled rank (SIGSTOP, then SIGCONT well before the deadline): the collectives in flight
complete with the right results; the waiting ranks log a stall report naming the late rank."""
from __future__ import annotations

import re
import signal
import time

import pytest
from cluster import finish_all, reports, start, stop_all

STOP_S = 1.5

# Checked all_sums until the harness says the stall is over: every rank agrees when to stop
# through an all_max of the flag, so all issue the same number of collectives.
BODY = """
flag = os.path.join(os.environ["FAULT_DIR"], "resumed")
x = np.arange(250_000, dtype=np.float32) % 97 + r
want = (np.arange(250_000, dtype=np.float32) % 97) * n + sum(range(n))
say("READY")
i = 0
until = time.monotonic() + 40
while time.monotonic() < until:
    got = all_sum(x)
    if not np.array_equal(got, want):
        say("WRONG", i)
        sys.exit(5)
    i += 1
    if all_max(np.array([os.path.exists(flag)], np.int32))[0]:
        break
say("DONE", i)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_stopped_rank_resumes_and_collectives_complete(tmp_path, backend):
    env = {"FAULT_DIR": str(tmp_path), "JACKLRING_TIMEOUT": "10", "JACKLRING_STALL_REPORT": "0.5"}
    procs = start(backend, 3, BODY, tmp_path, env=env)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        time.sleep(0.3)
        procs[1].kill(signal.SIGSTOP)
        time.sleep(STOP_S)
        procs[1].kill(signal.SIGCONT)
        time.sleep(0.3)
        (tmp_path / "resumed").touch()
        done = [int(p.wait_line("DONE", 30)[2]) for p in procs]
        codes = finish_all(procs, 20)
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGCONT)
        stop_all(procs)
    assert codes == [0, 0, 0], reports(procs)
    assert len(set(done)) == 1 and done[0] >= 2, done
    # a neighbour waiting on rank 1 reports the stall (JACKLRING_STALL_REPORT=0.5)
    stalls = [line for p in procs for line in p.stderr.splitlines() if "stalled" in line]
    assert stalls and any("rank 1" in line for line in stalls), reports(procs)
    if backend == "jaccl":
        # each waiting rank reports once per operation, naming the operation and the late rank
        # (the all_sum of the data or the all_max of the flag, whichever rank 1 was stopped in)
        late = [line for line in stalls if "from rank 1 " in line]
        pattern = r"rank [02]: all_reduce\((sum, float32, 1000000|max, int32, 4) bytes, seq \d+\) is stalled"
        assert late and all(re.match(pattern, line) for line in late), stalls
    print(stalls[0])
