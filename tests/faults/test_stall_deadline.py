"""A rank stopped for good (SIGSTOP) over TCP: the survivor's deadline (JACKLRING_TIMEOUT,
measured as silence) fires on time and names the stopped rank. The failing rank's abort
notice to the stopped peer must not wait out the handshake's answer timeout (it used to:
the error came 5 s late)."""
from __future__ import annotations

import signal
import time

import pytest
from cluster import start, stop_all

BODY = """
x = np.ones(1000, np.float32)
say("READY")
while True:
    try:
        all_sum(x)
    except ERRORS as exc:
        say("FAILED", getattr(exc, "culprit", None), one_line(exc))
        sys.exit(3)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deadline", [3, 6])
def test_the_deadline_fires_on_time_and_names_the_stopped_rank(tmp_path, deadline):
    env = {"JACKLRING_TIMEOUT": str(deadline), "JACKLRING_LOCAL_TRANSPORT": "tcp",
           "JACKLRING_STALL_REPORT": "0"}
    procs = start("ring", 2, BODY, tmp_path, env=env)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        time.sleep(0.3)
        stopped_at = procs[1].kill(signal.SIGSTOP)
        _, when, *fields = procs[0].wait_line("FAILED", deadline + 10)
    finally:
        procs[1].popen.send_signal(signal.SIGCONT)
        stop_all(procs)
    late = float(when) - stopped_at
    assert late < deadline + 1.0, f"the deadline of {deadline} s fired after {late:.1f} s: {fields}"
    _culprit, *message = fields
    assert "from rank 1 " in " ".join(message), fields
    print(f"deadline {deadline} s: error after {late:.2f} s: {' '.join(message)}")


@pytest.mark.timeout(60)
def test_over_shared_memory_every_survivor_names_the_stopped_rank(tmp_path):
    """Four ranks on one host (shared memory), rank 3 stopped: the survivors whose own wait
    timed out and those told of it by a peer all name rank 3, never a live rank."""
    env = {"JACKLRING_TIMEOUT": "3", "JACKLRING_STALL_REPORT": "0"}
    procs = start("ring", 4, BODY, tmp_path, env=env)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        time.sleep(0.3)
        stopped_at = procs[3].kill(signal.SIGSTOP)
        failed = [p.wait_line("FAILED", 15) for p in procs[:3]]
    finally:
        procs[3].popen.send_signal(signal.SIGCONT)
        stop_all(procs)
    for rank, when, culprit, *message in failed:
        text = " ".join(message)
        assert float(when) - stopped_at < 4.0, (rank, when, text)
        assert culprit in ("3", "None") and "rank 3" in text, failed
        assert not any(f"rank {live} died" in text for live in (0, 1, 2)), failed
        print(rank, culprit, text)
