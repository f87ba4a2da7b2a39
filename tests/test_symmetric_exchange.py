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
    pytest.param("ring", marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
        "ring send() writes the whole message to the socket before returning, so two ranks that "
        "send 16 MB to each other before receiving both block until CollectiveTimeout; fix in "
        "adapter/backends/ring/backend.py: queue the outgoing message on the peer's connection (as the "
        "JACCL TCP mesh does) or read incoming data while a send is blocked"))),
])
def test_symmetric_exchange_of_large_messages_does_not_deadlock(backend):
    r = launch(["--backend", backend, "-n", "2", f"{ROOT}/tests/jaccl_scripts/exchange.py"], timeout=50,
               env={"JACKLRING_TIMEOUT": "8"})
    assert r.returncode == 0, output_tail(r)
    assert rank_lines(r, "exchange ok") == ["exchange ok 0", "exchange ok 1"], output_tail(r)
