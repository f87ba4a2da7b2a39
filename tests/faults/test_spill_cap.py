"""The spill buffer's cap: two ranks that both send each other a message larger than
JACKLRING_P2P_SPILL_BYTES before receiving cannot both finish (each reads at most the cap of the
other's stream ahead), so both fail once nothing has moved for JACKLRING_TIMEOUT, naming the full
spill buffer, instead of hanging or growing memory without bound. (Before this test the JACCL
message did not mention the spill buffer, and the ring's read "timed out sending to rank 0:
send to rank 1".)"""
from __future__ import annotations

import pytest
from cluster import finish_all, reports, start, stop_all

CAP = 1 << 20          # JACKLRING_P2P_SPILL_BYTES
TIMEOUT_S = 2.0        # JACKLRING_TIMEOUT
SIZE_MIB = 64          # per message: well past the cap plus what the socket buffers hold
SLACK_S = 5.0          # a loaded 2-core machine (moving the bytes before the silence counts too)

BODY = """
count = (SIZE_MIB << 20) // 4
peer = 1 - r
barrier()
say("SENDING")
try:
    send(np.full(count, r + 1, np.float32), peer)
    say("NOERR")
except ERRORS as e:
    say("ERR", one_line(e))
    sys.exit(3)
""".replace("SIZE_MIB", str(SIZE_MIB))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_symmetric_exchange_past_the_spill_cap_fails_naming_the_full_buffer(tmp_path, backend):
    procs = start(backend, 2, BODY, tmp_path,
                  env={"JACKLRING_P2P_SPILL_BYTES": str(CAP), "JACKLRING_TIMEOUT": str(TIMEOUT_S)})
    try:
        began = [float(p.wait_line("SENDING", 30)[1]) for p in procs]
        errors = [p.wait_line("ERR", TIMEOUT_S + 20) for p in procs]
        codes = finish_all(procs, 10)
    finally:
        stop_all(procs)
    took = [float(e[1]) - b for e, b in zip(errors, began)]
    texts = [" ".join(e[2:]) for e in errors]
    print(backend, [f"{t:.2f} s: {m}" for t, m in zip(took, texts)])
    assert codes == [3, 3], reports(procs)
    for r, (t, text) in enumerate(zip(took, texts)):
        assert TIMEOUT_S - 0.1 <= t < TIMEOUT_S + SLACK_S, (r, t, text)
        assert f"rank {1 - r}" in text, (r, text)
    # Both ranks reach the deadline together; one may instead see the other give up first
    # (JACCL closes its mesh at once), so only the first to fail must be the timeout.
    first = min(range(2), key=lambda r: float(errors[r][1]))
    text = texts[first]
    assert text.startswith("CollectiveTimeout"), (first, text)
    assert f"spill buffer, which is full (JACKLRING_P2P_SPILL_BYTES={CAP})" in text, (first, text)
    for r, text in enumerate(texts):
        assert text.startswith("CollectiveTimeout") or text.startswith("PeerError"), (r, text)
