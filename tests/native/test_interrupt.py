"""Ctrl-C during a shared-memory wait raises KeyboardInterrupt in the waiting call at once (the
Python engine did so between its sleeps; the C wait asks Python's signal handlers after EINTR
and at each liveness check), and the peers learn that this rank left."""
from __future__ import annotations

import signal
import threading
import time

import pytest
from engine_segments import attach

from adapter.errors import PeerError


@pytest.mark.timeout(30)
@pytest.mark.parametrize("to_main", [True, False], ids=["signal-to-the-waiter", "signal-to-another-thread"])
def test_sigint_ends_a_wait_for_a_peer_that_never_comes(to_main):
    groups = attach(2)
    main = threading.get_ident()
    try:
        def interrupt():
            time.sleep(0.3)
            if to_main:
                signal.pthread_kill(main, signal.SIGINT)
            else:
                signal.raise_signal(signal.SIGINT)  # delivered to this (non-main) thread
        threading.Thread(target=interrupt).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            groups[0].barrier()  # member 1 never arrives
        assert time.monotonic() - start < 5
        groups[1].barrier()  # the step member 0 published before it was interrupted
        with pytest.raises(PeerError, match="left the group after an error"):
            groups[1].barrier()
    finally:
        for g in groups:
            g.close()
