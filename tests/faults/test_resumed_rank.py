"""A rank that was stopped (SIGSTOP) and resumes must never get a healthy rank thrown out.

While it was stopped the others timed out and started shrinking without it. When it resumes,
its own operation fails; it used to blame the live neighbour whose link closed ("rank 3 reported
that it gave up"), and with the usual recipe (shrink(exclude=[culprit_of(e)])) it joined the
agreement before a slow survivor did (one still writing a checkpoint), and the coordinator took
the union of every joiner's exclude=: the healthy slow survivor was evicted. Issue #48, item 1.
"""
from __future__ import annotations

import os
import signal

import pytest
from cluster import finish_all, reports, start, stop_all

# Each rank sums until its loop fails, then shrinks with exclude=[the rank its error blames], as
# docs/torch.md's recipe does; rank 3 is LATE seconds slower to shrink (a checkpoint, say).
RECIPE = """
import adapter
x = np.full(1024, float(r + 1), np.float32)
all_sum(x)
say("READY")
culprit = None
try:
    while True:
        all_sum(x)
except ERRORS as e:
    culprit = adapter.culprit_of(e)
    say("ERR", culprit, type(e).__name__, str(e).replace("\\n", " ")[:300])
if r == 3:
    time.sleep({late})
if r == 2 and {insist}:
    culprit = 3  # as if its error still blamed the live neighbour: the agreement must not take it
say("SHRINKING")
try:
    new = group.shrink(exclude=[] if culprit is None else [culprit], timeout={window})
except ERRORS as e:
    say("SHRINKERR", type(e).__name__, str(e).replace("\\n", " "))
    sys.exit(5)
members = all_gather(np.array([r], np.int64))
y = all_sum(np.full(16, float(r + 1), np.float32))
say("SUM", ",".join(str(int(m)) for m in members), float(y[0]))
time.sleep(1)  # answer the excluded rank's late join
"""

TRIALS = int(os.environ.get("FAULT_REPEAT", "1"))


# The plain TCP case runs when FAULT_REPEAT is set; by default the case where the
# resumed rank insists covers TCP's blame (its ERR line) and the agreement's rule at once.
CASES = [("auto", False), ("tcp", True)] + ([("tcp", False)] if "FAULT_REPEAT" in os.environ else [])


@pytest.mark.timeout(60 * TRIALS)
@pytest.mark.parametrize("transport,insist", CASES)
def test_a_resumed_rank_does_not_get_a_slow_survivor_evicted(tmp_path, transport, insist):
    """insist: the resumed rank asks to exclude live rank 3 all the same (the
    agreement alone must refuse it: the others count rank 2 as failed)."""
    for trial in range(TRIALS):
        (tmp_path / f"t{trial}").mkdir()
        procs = start("ring", 4, RECIPE.format(late=3.0, window=8.0, insist=insist), tmp_path / f"t{trial}",
                      env={"JACKLRING_TIMEOUT": "2", "JACKLRING_LOCAL_TRANSPORT": transport})
        try:
            for p in procs:
                p.wait_line("READY", 30)
            procs[2].kill(signal.SIGSTOP)  # the others' loop fails at the 2 s deadline
            for q in (0, 1):
                procs[q].wait_line("SHRINKING", 20)
            procs[2].kill(signal.SIGCONT)  # it joins the agreement before rank 3 does
            resumed = procs[2].wait_line("ERR", 20)
            sums = {q: procs[q].wait_line("SUM", 30) for q in (0, 1, 3)}
            excluded = procs[2].wait_line("SHRINKERR", 20)
            finish_all(procs, 15)
        except AssertionError as exc:
            finish_all(procs, 5)
            raise AssertionError(f"{exc}\n\nevery rank's report:\n{reports(procs)}") from None
        finally:
            stop_all(procs)
        # Its own error blames no live rank (the others gave up on it, not it on them).
        assert resumed[2] == "None", resumed
        for q, fields in sums.items():
            assert fields[2:] == ["0,1,3", "7.0"], (q, fields, reports(procs))
        text = " ".join(excluded[3:])
        assert excluded[2] == "ExcludedError", excluded
        # It says who asked for the exclusion: the survivors whose exclude= named it.
        assert "at the request of old ranks [0, 1" in text, text
