"""kill -9 of a rank while split() forms the sub-groups (after the parent exchanged addresses,
before the victim connects its sub-group): with a 120 s connect deadline every other rank, in
the victim's sub-group or not, raises within a second or two, naming the victim by its parent
rank and its rank in the sub-group."""
from __future__ import annotations

import pytest
from cluster import finish_all, reports, start, stop_all

VICTIM = 2
LIMIT_S = 2.0  # the bound is ~1 s; the rest is slack for a loaded 2-core machine

BODY = """
import signal

def die(*args, **kwargs):
    say("KILLED")
    os.kill(os.getpid(), signal.SIGKILL)

if r == VICTIM:  # dies as it connects its sub-group (after the parent's address exchange)
    from adapter.backends.transport import tcp
    tcp.connect = tcp.connect_with_hello = die  # the ring's connections take the second
barrier()
try:
    sub = group.split(r % 2)
    say("NOERR", sub.rank())
except ERRORS as e:
    say("ERR", one_line(e))
    sys.exit(3)
""".replace("VICTIM", str(VICTIM))


@pytest.mark.timeout(40)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_death_during_split_is_seen_by_every_rank_at_once(tmp_path, backend):
    procs = start(backend, 4, BODY, tmp_path, env={"JACKLRING_CONNECT_TIMEOUT": "120"})
    try:
        killed_at = float(procs[VICTIM].wait_line("KILLED", 30)[1])
        errors = {}
        for p in procs:
            if p.rank != VICTIM:
                fields = p.wait_line("ERR", 10)
                errors[p.rank] = (float(fields[1]) - killed_at, " ".join(fields[2:]))
        codes = finish_all(procs, 10)
    finally:
        stop_all(procs)
    print({r: f"{t:.2f} s: {m}" for r, (t, m) in errors.items()})
    assert [c for i, c in enumerate(codes) if i != VICTIM] == [3, 3, 3], reports(procs)
    slow = {r: t for r, (t, _) in errors.items() if not t < LIMIT_S}
    assert not slow, f"raised only after {slow} s\n{reports(procs)}"
    for r, (_, text) in errors.items():
        assert f"parent rank {VICTIM}" in text and "rank 1 of the sub-group" in text, (r, text)
