"""recv with the wrong size or dtype, or an unsupported dtype: the error comes without leaving
the stream out of step, so the next recv from that peer gets the next message (ring), or the
group says it is unusable (JACCL marks the whole group after any error)."""
from __future__ import annotations

import pytest
from cluster import finish_all, reports, start, stop_all

# Rank 0 sends a 4000-byte float32 message, then a small int32 one. Rank 1 first asks for
# WRONG, then for the small message.
BODY = """
barrier()
if r == 0:
    send(np.arange(1000, dtype=np.float32), 1)
    send(np.array([7, 8, 9], np.int32), 1)
    barrier_ok = True
else:
    try:
        WRONG
        say("NOERR")
    except Exception as e:
        say("FIRST", one_line(e))
    try:
        got = recv((3,), np.int32, 0)
        say("SECOND", "ok" if got.tolist() == [7, 8, 9] else f"wrong {got.tolist()}")
    except Exception as e:
        say("SECOND", one_line(e))
"""

WRONG = {
    "size": ("recv((500,), np.float32, 0)", "MismatchError"),
    "dtype": ("recv((500,), np.float64, 0)", "MismatchError"),
    # Refused before a byte is read: the float32 message is then still first in the stream.
    "object": ("recv((4,), object, 0); say('UNREACHED')", "TypeError"),
}


@pytest.mark.timeout(40)
@pytest.mark.parametrize("case", sorted(WRONG))
def test_ring_recv_mismatch_leaves_the_stream_in_step(tmp_path, case):
    call, error = WRONG[case]
    body = BODY.replace("WRONG", call)
    if case == "object":  # the first message must still be there for a correct recv
        body = body.replace("got = recv((3,), np.int32, 0)",
                            "first = recv((1000,), np.float32, 0); got = recv((3,), np.int32, 0)")
    procs = start("ring", 2, body, tmp_path)
    try:
        first = " ".join(procs[1].wait_line("FIRST", 20)[2:])
        second = " ".join(procs[1].wait_line("SECOND", 20)[2:])
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert first.startswith(error), first
    if case != "object":
        assert "discarded" in first and "rank 0" in first, first
    assert second == "ok", f"{second}\n{reports(procs)}"
    assert codes == [0, 0], reports(procs)


@pytest.mark.timeout(40)
def test_jaccl_recv_mismatch_marks_the_group_unusable(tmp_path):
    body = BODY.replace("WRONG", WRONG["size"][0]).replace("barrier_ok = True", "time.sleep(1)")
    procs = start("jaccl", 2, body, tmp_path)
    try:
        first = " ".join(procs[1].wait_line("FIRST", 20)[2:])
        second = " ".join(procs[1].wait_line("SECOND", 20)[2:])
        finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert first.startswith("MismatchError"), first
    assert "unusable" in second, second
