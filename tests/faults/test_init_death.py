"""kill -9 of a rank during init(), once it has made a connection of the formation: with a
120 s connect deadline every other rank raises within seconds (the target is 1 s), naming the
victim. The victim kills itself right after a chosen connection's handshake succeeded, and the
rank that would connect to it next (SLOW) holds its connections back for a second, so that it
finds the victim gone (connection refused, which alone looks like a rank not started yet): the
point is the same on every run whatever the machine's load."""
from __future__ import annotations

import pytest
from cluster import finish_all, rank_envs, reports, start, stop_all

LIMIT_S = 5.0  # the target is 1 s; the rest is slack for a loaded 2-core machine
RING, SIDE_CHANNEL, MESH = 1, 0x4A43, 0x4A4D  # the handshake purposes (ring, JACCL side channel, TCP mesh)

BEFORE_INIT = """
import signal
from adapter.backends.transport import tcp

real_connect = tcp.connect_with_hello  # tcp.connect goes through it too

if r == SLOW:
    def connect(addr, hello, *args, **kwargs):
        if hello.purpose == PURPOSE:
            time.sleep(1.0)
        return real_connect(addr, hello, *args, **kwargs)
    tcp.connect_with_hello = connect

if r == VICTIM:

    def connect(addr, hello, *args, **kwargs):
        done = real_connect(addr, hello, *args, **kwargs)
        if hello.purpose == PURPOSE:  # connected (the peer acknowledged): die now
            say("KILLED", hello.receiver)
            os.kill(os.getpid(), signal.SIGKILL)
        return done
    tcp.connect_with_hello = connect
"""


def run_init_death(tmp_path, backend: str, victim: int, purpose: int, slow: int,
                   n: int = 4) -> dict[int, tuple[float, str]]:
    """{survivor: (seconds from the kill to its init error, the error)}."""
    prelude = (BEFORE_INIT.replace("VICTIM", str(victim)).replace("PURPOSE", str(purpose))
               .replace("SLOW", str(slow)))
    procs = start(backend, n, "say('FORMED')", tmp_path,
                  env={"JACKLRING_CONNECT_TIMEOUT": "120", "FAULT_BEFORE_INIT": prelude})
    try:
        killed_at = float(procs[victim].wait_line("KILLED", 30)[1])
        errors = {}
        for p in procs:
            if p.rank != victim:
                fields = p.wait_line("INITERR", 15)
                errors[p.rank] = (float(fields[1]) - killed_at, " ".join(fields[2:]))
        codes = finish_all(procs, 10)
    finally:
        stop_all(procs)
    print({r: f"{t:.2f} s: {m}" for r, (t, m) in errors.items()})
    assert [c for i, c in enumerate(codes) if i != victim] == [4] * (n - 1), reports(procs)
    slow = {r: round(t, 2) for r, (t, _) in errors.items() if not t < LIMIT_S}
    assert not slow, f"raised only after {slow} s\n{reports(procs)}"
    for r, (_, text) in errors.items():
        assert f"rank {victim} died" in text or f"rank {victim} (" in text, (r, text)
    assert "Traceback" not in "".join(p.stderr for p in procs), reports(procs)
    return errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [2, 0])
def test_ring_death_after_the_first_ring_connection(tmp_path, victim):
    errors = run_init_death(tmp_path, "ring", victim, RING, slow=(victim - 1) % 4)
    for r, (_, text) in errors.items():
        assert "while the group formed" in text, (r, text)


@pytest.mark.timeout(60)
def test_jaccl_death_after_joining_the_side_channel(tmp_path):
    run_init_death(tmp_path, "jaccl", 2, SIDE_CHANNEL, slow=3)


@pytest.mark.timeout(60)
def test_jaccl_death_after_the_first_mesh_connection(tmp_path):
    errors = run_init_death(tmp_path, "jaccl", 2, MESH, slow=3)  # rank 3 connects to 0, 1, 2
    for r, (_, text) in errors.items():
        assert "while the group formed" in text, (r, text)


# The victim listens, lives LIVES_S, then dies before its first connection of the formation; its
# left neighbour holds its own connections back longer than that, so nobody connected to or from
# the victim. Only its right neighbour's probes of its listener (answered, then refused) tell.
BEFORE_ANY_CONNECTION = """
import signal
from adapter.backends.transport import tcp

real_connect = tcp.connect_with_hello

if r == SLOW:
    def connect(addr, hello, *args, **kwargs):
        if hello.purpose == 1:
            time.sleep(3.0)
        return real_connect(addr, hello, *args, **kwargs)
    tcp.connect_with_hello = connect

if r == VICTIM:
    def connect(addr, hello, *args, **kwargs):
        if hello.purpose == 1:
            time.sleep(LIVES_S)  # its listener answers meanwhile
            say("KILLED", hello.receiver)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_connect(addr, hello, *args, **kwargs)
    tcp.connect_with_hello = connect
"""


@pytest.mark.timeout(60)
def test_ring_death_before_any_connection_is_named_without_the_deadline(tmp_path):
    """kill -9 of a ring rank that listened but made no connection, with a 120 s connect
    deadline: every survivor names it within seconds (a rank never started still costs the
    deadline: tests/faults/test_missing_rank.py)."""
    n, victim = 4, 2
    prelude = (BEFORE_ANY_CONNECTION.replace("VICTIM", str(victim)).replace("SLOW", str(victim - 1))
               .replace("LIVES_S", "1.5"))
    procs = start("ring", n, "say('FORMED')", tmp_path,
                  env={"JACKLRING_CONNECT_TIMEOUT": "120", "FAULT_BEFORE_INIT": prelude})
    try:
        killed_at = float(procs[victim].wait_line("KILLED", 30)[1])
        errors = {}
        for p in procs:
            if p.rank != victim:
                fields = p.wait_line("INITERR", 15)
                culprit = p.tagged("CULPRIT")[0][2] if p.tagged("CULPRIT") else None
                errors[p.rank] = (float(fields[1]) - killed_at, culprit, " ".join(fields[2:]))
        codes = finish_all(procs, 10)
    finally:
        stop_all(procs)
    print({r: f"{t:.2f} s, culprit {c}: {m}" for r, (t, c, m) in errors.items()})
    assert [c for i, c in enumerate(codes) if i != victim] == [4] * (n - 1), reports(procs)
    for r, (took, culprit, text) in errors.items():
        assert took < LIMIT_S, (r, took, text)
        assert str(culprit) == str(victim), (r, culprit, text)
        assert f"rank {victim} died" in text, (r, text)


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_listen_at_its_address_tells_its_neighbours(tmp_path):
    """Rank 2's port is held by a listener of another job (a port collision between two jobs on
    one host): rank 2 cannot listen and raises at once; the others, with a 30 s connect deadline,
    raise within seconds naming rank 2 instead of waiting for it (rank 1 meanwhile reaches the
    other job at that address, which refuses it as another job's)."""
    import json

    from adapter.backends.transport import auth, tcp

    envs = rank_envs("ring", 4, tmp_path)
    host, port = json.loads((tmp_path / "ring-hosts.json").read_text())[2][0].rsplit(":", 1)
    other = b"another job"
    holder = tcp.Listener(host, int(port))
    try:
        holder.serve(auth.job_auth(other, "another job"), auth.context_id(other), 2, lambda h: "another job",
                     "another job")
        # Rank 2 starts a little after the others, so they listen (and wait for it) by then.
        late = "if r == 2:\n    time.sleep(1.5)\n"
        procs = start("ring", 4, "say('FORMED')", tmp_path, envs=envs,
                      env={"JACKLRING_CONNECT_TIMEOUT": "30", "FAULT_BEFORE_INIT": late})
        try:
            failed = procs[2].wait_line("INITERR", 30)
            assert "cannot listen" in " ".join(failed), failed
            errors = {}
            for p in (procs[0], procs[1], procs[3]):
                fields = p.wait_line("INITERR", 15)
                culprit = p.tagged("CULPRIT")[0][2] if p.tagged("CULPRIT") else None
                errors[p.rank] = (float(fields[1]) - float(failed[1]), culprit, " ".join(fields[2:]))
            codes = finish_all(procs, 10)
        finally:
            stop_all(procs)
    finally:
        holder.close()
    print({r: f"{t:.2f} s, culprit {c}: {m}" for r, (t, c, m) in errors.items()})
    assert codes == [4, 4, 4, 4], reports(procs)
    for r, (took, culprit, text) in errors.items():
        assert took < LIMIT_S, (r, took, culprit, text)
    for r in (1, 3):  # told by rank 2 itself, or first by a rank that was
        assert errors[r][1] == "2" and "rank 2" in errors[r][2], errors[r]
