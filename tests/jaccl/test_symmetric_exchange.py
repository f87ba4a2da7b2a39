"""Two ranks that each send 16 MB to the other before receiving: larger than any socket buffer,
so a backend must not block in send until the peer receives. (The contract's 2 MB exchange,
tests/contract, fits in the ring's socket buffers; this one does not.)"""
from __future__ import annotations

import pytest
from ranks import ROOT, launch, output_tail, rank_lines


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", [
    "jaccl",
    "mpi",
    "ring",
])
def test_symmetric_exchange_of_large_messages_does_not_deadlock(backend):
    r = launch(["--backend", backend, "-n", "2", f"{ROOT}/tests/jaccl_scripts/exchange.py"], timeout=50,
               env={"JACKLRING_TIMEOUT": "8"})
    assert r.returncode == 0, output_tail(r)
    assert rank_lines(r, "exchange ok") == ["exchange ok 0", "exchange ok 1"], output_tail(r)
