"""NCCL's unique id handed over through a key-value store (torch's TCPStore, which has no
authentication), as an authenticated record (store_records): rank 0 publishes the id MACed
under the job key and bound to its key name; every other rank verifies it before NCCL sees it.
An id an outsider wrote there would put the ranks in the outsider's NCCL clique (NCCL's own
bootstrap trusts the id): it is refused with an IntegrityError naming the key, and a missing id
is a DistributedError naming rank 0, both within wait_s.

(The TCP exchange of backends/nccl/bootstrap.py authenticates its connections instead; this
one lives here, above the backends, because its records are the store ring's.)"""
from __future__ import annotations

import functools
from typing import Callable

from ..backends.transport import auth
from ..errors import IntegrityError
from . import store_records

MAX_ID_BYTES = 1024  # NCCL's is 128; a record is at most store_records.MAX_RECORD_BYTES


def exchange_id_via_store(store, key: str, rank: int, size: int, make_id: Callable[[], bytes],
                          job: auth.Auth, wait_s: float) -> bytes:
    """Every rank's copy of one unique id: rank 0 makes it and publishes it at `key`/0 as a
    record MACed under `job` (the group's key: store_ring.store_auth gives it), the others wait
    up to wait_s for it and verify it. `key` must name this group and formation alone (an id
    left by an earlier one fails its check, since the record binds the group's size and key).

    A record of an earlier run under the same key names (same secret, same store keys) passes
    its MAC, and its id would send the ranks to an old root's address, where an outsider may
    listen. So, as the store ring's addresses are: every rank publishes a record (rank 0's holds
    the id; the others' only their nonce of this exchange) and then a seal of the nonces it read;
    a rank that read a replayed record raises an IntegrityError naming its key, before NCCL
    sees any id."""
    book = store_records.RecordBook(store, f"{key}/", job, rank, size, what="nccl_id")
    unique_id = b""
    if rank == 0:
        unique_id = bytes(make_id())
        if len(unique_id) > MAX_ID_BYTES:
            raise ValueError(f"an NCCL unique id of {len(unique_id)} bytes (at most {MAX_ID_BYTES})")
    mine = book.publish(unique_id.hex())
    told = functools.partial(store_records.told_tampering, store, f"{key}/", job, rank, size)
    try:
        records = book.gather(mine, wait_s)
        with book.defended(mine):
            store_records.seal(store, f"{key}/", job, rank, records, wait_s, book.key_name,
                               watch=lambda missing: _stopped(rank, records, missing, told))
    except IntegrityError as exc:  # peers waiting for this rank's seal name the tampering, at once
        store_records.tell_tampering(store, f"{key}/", job, rank, size, book.run, str(exc))
        raise
    if rank == 0:
        return unique_id
    try:
        unique_id = bytes.fromhex(records[0].value)
    except ValueError:  # a rank holding the key wrote it, so this is a bug, not an outsider
        raise IntegrityError(f"rank {rank}: the NCCL id record at store key {book.key_name(0)!r} is not hex") from None
    if not unique_id:
        raise IntegrityError(f"rank {rank}: the NCCL id record at store key {book.key_name(0)!r} holds no id")
    return unique_id


def _stopped(rank: int, records: list[store_records.Record], missing: list[int],
             told: Callable[[int, str], "str | None"]) -> None:
    """IntegrityError with the words of the first rank that has not sealed because it found a
    tampered record (it said so in the store, under its nonce of this exchange), instead of
    waiting wait_s for its seal."""
    for q in missing:
        verdict = told(q, records[q].run)
        if verdict is not None:
            raise IntegrityError(f"rank {rank}: jacklring rendezvous: rank {q} stopped exchanging the NCCL id: "
                                 f"{verdict}")
