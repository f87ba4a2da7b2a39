"""Liveness probes (transport/blame.answers) against a squatted abstract Unix name: the outsider
(uid 65534, standard library only) holds the Unix names of two ranks' addresses first and
answers every probe there as a live rank would. Before, the prober believed it: a dead rank
(nothing at its TCP address) looked alive, and a stopped one (its kernel accepts on TCP,
nobody answers) too, so the error named the wrong rank. Now the prober checks the peer's uid
(SO_PEERCRED), as every other Unix connection does, and asks the TCP address instead."""
from __future__ import annotations

import socket
import time

import pytest
from security_helpers import outsider_fixture, wait_ready  # noqa: F401  (the `outsider` fixture)

from adapter.backends.transport import blame
from adapter.bench import free_ports


@pytest.mark.timeout(60)
def test_a_squatted_unix_name_does_not_make_a_dead_or_stopped_rank_look_alive(outsider):
    dead_port, stopped_port = free_ports(2)
    dead, stopped = f"127.0.0.1:{dead_port}", f"127.0.0.1:{stopped_port}"
    squatter = outsider("alive_squat.py", dead, stopped)
    wait_ready(squatter)
    # A stopped rank: its listening socket is open (the kernel accepts for it), nobody answers.
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", stopped_port))
    frozen.listen(8)
    try:
        assert blame.answers(dead, 7, 0, 1, time.monotonic() + 2) == blame.GONE
        begin = time.monotonic()
        assert blame.answers(stopped, 7, 0, 1, time.monotonic() + 0.5) == blame.SILENT
        assert time.monotonic() - begin < 2
    finally:
        frozen.close()
