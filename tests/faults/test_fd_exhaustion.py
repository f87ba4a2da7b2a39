"""File descriptors exhausted (RLIMIT_NOFILE lowered to what is open) during split(): a
ResourceExhausted (a DistributedError) naming the operation and the limit on that rank, and a
prompt error on the others instead of a wait for the deadline."""
from __future__ import annotations

import pytest
from cluster import finish_all, reports, start, stop_all

BODY = """
import resource
barrier()
if r == 0:
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    filler = []
    try:
        while True:  # fill any gaps below the limit too
            filler.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
try:
    group.split(0)
    say("NOERR")
except ERRORS as e:
    say("ERR", one_line(e))
    sys.exit(3)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_fd_exhaustion_in_split_names_the_operation_and_the_limit(tmp_path, backend):
    procs = start(backend, 2, BODY, tmp_path, env={"JACKLRING_TIMEOUT": "30"})
    try:
        errors = [p.wait_line("ERR", 10) for p in procs]
        codes = finish_all(procs, 10)
    finally:
        stop_all(procs)
    texts = [" ".join(e[2:]) for e in errors]
    print(backend, texts)
    assert codes == [3, 3], reports(procs)
    assert texts[0].startswith("ResourceExhausted"), texts[0]
    assert "socket()" in texts[0] and "RLIMIT_NOFILE" in texts[0] and "Too many open files" in texts[0], texts[0]
    assert abs(float(errors[1][1]) - float(errors[0][1])) < 3.0, texts
