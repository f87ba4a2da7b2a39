"""dist.shrink_group on the jacklring process group: kill -9 of a rank, the survivors shrink the
default group and the next all_reduce on it is right."""
from __future__ import annotations

import signal
import time

import pytest
from cluster import finish_all, reports, start, stop_all

BODY = """
x = np.full(4096, float(r + 1), np.float32)
all_sum(x)
say("READY")
try:
    while True:
        all_sum(x)
except ERRORS as e:
    say("ERR", type(e).__name__)
pg = dist.shrink_group([2])
assert pg is dist.group.WORLD or dist.get_world_size() == 2
y = all_sum(np.full(4096, float(r + 1), np.float32))
say("SUM", dist.get_rank(), dist.get_world_size(), float(y[0]), pg.supports_shrinking)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_shrink_group_after_kill9_and_the_next_all_reduce_is_right(tmp_path):
    pytest.importorskip("torch")
    procs = start("torch", 3, BODY, tmp_path)
    try:
        for p in procs:
            p.wait_line("READY", 80)
        time.sleep(0.3)
        procs[2].kill(signal.SIGKILL)
        sums = [procs[q].wait_line("SUM", 40) for q in (0, 1)]
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert [s[2:] for s in sums] == [["0", "2", "3.0", "True"], ["1", "2", "3.0", "True"]], reports(procs)
    assert codes[:2] == [0, 0], reports(procs)
