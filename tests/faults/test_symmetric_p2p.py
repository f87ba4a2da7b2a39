"""Two ranks that both send a large message to each other before receiving (256 MiB each way)
must not deadlock, and messages between two ranks keep their order (a small message sent after
the large one arrives after it)."""
from __future__ import annotations

import pytest
from cluster import finish_all, reports, start, stop_all

BODY = """
count = (SIZE_MIB << 20) // 4
peer = 1 - r
mine = np.full(count, r + 1, np.float32)
barrier()
start = time.monotonic()
try:
    send(mine, peer)
    send(np.array([r + 10], np.int64), peer)
    got = recv((count,), np.float32, peer)
    tail = recv((1,), np.int64, peer)
except ERRORS as e:
    say("ERR", one_line(e))
    sys.exit(3)
took = time.monotonic() - start
ok = got[0] == peer + 1 and got[-1] == peer + 1 and (got == peer + 1).all() and tail[0] == peer + 10
say("DONE", "ok" if ok else "wrong", f"{took:.2f}", f"{2 * (SIZE_MIB << 20) / took / 1e6:.0f}")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_symmetric_256_mib_exchange_completes_in_order(tmp_path, backend):
    procs = start(backend, 2, BODY.replace("SIZE_MIB", "256"), tmp_path, env={"JACKLRING_TIMEOUT": "10"})
    try:
        done = [p.wait_line("DONE", 100)[2:] for p in procs]
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    print(backend, done)
    assert codes == [0, 0], reports(procs)
    assert [d[0] for d in done] == ["ok", "ok"], done
