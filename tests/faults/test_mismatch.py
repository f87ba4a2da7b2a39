"""Mismatched collectives (different op, size or dtype on two ranks): MismatchError on both
ranks, naming both ranks and both requests."""
from __future__ import annotations

import pytest
from cluster import finish_all, reports, start, stop_all

# What rank 1 calls differently from rank 0, and words both ranks' messages must contain.
CASES = {
    "op": ("all_max(np.ones(1000, np.float32))", ["max", "sum"]),
    "size": ("all_sum(np.ones(300_000, np.float32))", ["4000", "1200000"]),
    "dtype": ("all_sum(np.ones(1000, np.float64))", ["float32", "float64"]),
}

BODY = """
barrier()
try:
    if r == 1:
        RANK1
    else:
        all_sum(np.ones(1000, np.float32))
except ERRORS as e:
    say("ERR", one_line(e))
    sys.exit(3)
say("NOERR")
"""


def check_both_named(procs, words: list[str]) -> list[str]:
    messages = []
    for p in procs:
        fields = p.wait_line("ERR", 30)
        messages.append(" ".join(fields[2:]))
    codes = finish_all(procs, 20)
    assert codes == [3] * len(procs), reports(procs)
    for text in messages:
        assert "MismatchError" in text, messages
        assert "rank 0" in text and "rank 1" in text, messages
        missing = [w for w in words if w not in text]
        assert not missing, f"{missing} not in {text!r}"
    return messages


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_raises_on_both_ranks_naming_both(tmp_path, backend, case):
    call, words = CASES[case]
    procs = start(backend, 2, BODY.replace("RANK1", call), tmp_path)
    try:
        messages = check_both_named(procs, words)
    finally:
        stop_all(procs)
    print(f"{backend} {case}: {messages}")


TORCH_BODY = """
import torch.distributed as dist
for case, call in CASES:
    sub = dist.new_group([0, 1])
    x = torch.ones(1000, dtype=torch.float32)
    try:
        if r == 1:
            if case == "op":
                dist.all_reduce(x, op=dist.ReduceOp.MAX, group=sub)
            elif case == "size":
                dist.all_reduce(torch.ones(300_000), group=sub)
            else:
                dist.all_reduce(torch.ones(1000, dtype=torch.float64), group=sub)
        else:
            dist.all_reduce(x, group=sub)
    except Exception as e:
        say("ERR", case, one_line(e))
        continue
    say("NOERR", case)
say("END")
""".replace("CASES", repr([(c, None) for c in ("op", "size", "dtype")]))


@pytest.mark.timeout(120)
def test_torch_process_group_mismatch_raises_on_both_ranks(tmp_path):
    pytest.importorskip("torch")
    procs = start("torch", 2, TORCH_BODY, tmp_path)
    try:
        for p in procs:
            p.wait_line("END", 90)
        finish_all(procs, 20)
    finally:
        stop_all(procs)
    for p in procs:
        errs = {f[2]: " ".join(f[3:]) for f in p.tagged("ERR")}
        assert sorted(errs) == ["dtype", "op", "size"], p.report()
        for case, text in errs.items():
            assert "MismatchError" in text and "rank 0" in text and "rank 1" in text, (case, text)
            missing = [w for w in CASES[case][1] if w not in text]
            assert not missing, f"{case}: {missing} not in {text!r}"
        print(f"torch rank {p.rank}: {errs}")
