"""The shared-memory doorbells cannot be taken first by another user of the host.

Abstract Unix names are listed in /proc/net/unix for every user, so an outsider sees the names a
job binds. A name it could derive from one it saw (a shared nonce plus a rank number) could be
bound first, and the job would lose its shared memory. Each rank's doorbell is therefore bound
under a random name of its own before the set-up records publish it: whatever a record says, the
name is already taken by its owner. Two ranks are formed here in threads of this process, with a
gather that plays the outsider: on every record it sees, it tries to bind every name the record
could let it derive."""
from __future__ import annotations

import socket
import threading

import pytest

from adapter.backends.local import shm

pytestmark = pytest.mark.skipif(shm.unusable_here() is not None,
                                reason=f"no shared memory here: {shm.unusable_here()}")


def derivable_names(record: dict, size: int) -> list[bytes]:
    names = []
    if "bell" in record:
        names.append(bytes.fromhex(record["bell"]))
    if "nonce" in record:  # sibling names of a shared nonce
        names += [f"\0jacklring-shm-{record['nonce']}-{q}".encode() for q in range(size)]
    return names


def test_no_doorbell_name_a_record_reveals_can_be_bound_by_someone_else():
    size = 2
    barrier = threading.Barrier(size, timeout=10)
    slots: list = [None] * size
    squatted: list[bytes] = []
    seen: list[bytes] = []
    lock = threading.Lock()

    def gather_for(rank: int):
        def gather(record: bytes) -> list[bytes]:
            slots[rank] = record
            barrier.wait()
            records = list(slots)
            barrier.wait()
            if rank == 0:
                for raw in records:
                    for name in derivable_names(shm._unpack(raw), size):
                        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                        try:
                            probe.bind(name)
                            with lock:
                                squatted.append(name)
                        except OSError:
                            with lock:
                                seen.append(name)
                        finally:
                            probe.close()
            barrier.wait()
            return records
        return gather

    placements: list = [None] * size
    errors: list = []

    def member(rank: int) -> None:
        try:
            placements[rank] = shm.form(rank, size, gather_for(rank), 1 << 16, wanted=True)
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    try:
        assert not errors, errors
        assert not squatted, f"doorbell names that another process could bind first: {squatted}"
        assert len(seen) == size, seen  # every rank's name was published, and already bound
        assert all(p is not None and p.shared for p in placements)
    finally:
        for p in placements:
            if p is not None and p.group is not None:
                p.group.close()
