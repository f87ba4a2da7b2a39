"""Growing a ring group formed through a torch store (torchrun's env://, Slurm): the store is
where members and newcomer find each other, as the hostfile is for a launcher's job.

A newcomer is a process started like the job's ranks (the same MASTER_ADDR / MASTER_PORT, or
the same Slurm step's variables) with JACKLRING_JOIN=1 and its rank (RANK, SLURM_PROCID) set
to a vacant slot. It computes the job key as the ranks did (store_ring.store_auth), opens a
listener and publishes a *knock record* at `<formation prefix>knock/<slot>`: its address and a
fresh id, MACed under the job key and bound to the key name like every store record
(store_records.RecordBook), kept in place while it waits (an outsider's overwrite is put
back). Rank 0 of the members reads the knock records of the vacant slots (StoreOrigin.find)
and recruits each newcomer at its address through grow's authenticated handshake; everything
after that is the hostfile path's (backends/ring/grow.py). A record whose id a grow already took
in is stale (its newcomer joined, or died after) and is passed over; one that fails its MAC is
reported as tampering.

Under env:// and Slurm the store's server lives in rank 0's process: when slot 0 is vacant the
store died with it, and both a newcomer for slot 0 and the members' grow() refuse at once.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Iterator

from ..backends.ring import lineage
from ..backends.transport import auth, tcp
from ..errors import DistributedError, IntegrityError
from . import store_records

log = logging.getLogger("jacklring.grow")

KNOCK = "knock/"


@dataclass(frozen=True)
class StoreSource:
    """How a newcomer reaches the store of a group: `where` names it (for errors), `in_rank0`
    says its server runs in rank 0's process (env://, Slurm), so it ends with rank 0."""
    where: str
    in_rank0: bool


def died_with_rank0(source: StoreSource) -> str:
    return (f"the store ({source.where}) was served by rank 0's process (slot 0), which is gone: the store died "
            f"with it, so no newcomer can be found through it (start the job again to get back to full size)")


class StoreOrigin:
    """A store ring's origin (lineage.Origin): newcomers knock in the store under `prefix` (the
    formation's), proving `job` (the key its ranks formed under)."""

    def __init__(self, store, prefix: str, job: auth.Auth, size: int, host: str, source: StoreSource) -> None:
        self._store = store
        self._prefix = prefix
        self._job = job
        self._auth = job.derive(b"jacklring-store-grow")
        self._size = size
        self._host = host
        self.source = source

    def _book(self, slot: int) -> store_records.RecordBook:
        return store_records.RecordBook(self._store, self._prefix + KNOCK, self._job, slot, self._size, what="knock")

    def size(self) -> int:
        return self._size

    def auth(self) -> auth.Auth:
        return self._auth

    def token(self) -> int:
        return auth.context_id(json.dumps([self._prefix, self._size, "grow"]).encode())

    def refusal(self, held: list[int]) -> str | None:
        if self.source.in_rank0 and 0 not in held:
            return died_with_rank0(self.source)
        return None

    def where(self, slot: int) -> str:
        return f"store key {self._prefix}{KNOCK}{slot}"

    def find(self, slot: int, used: frozenset[str]) -> lineage.Found | str:
        book = self._book(slot)
        name = book.key_name(slot)
        try:
            raw = store_records.read(self._store, name)
        except Exception as exc:  # the store's server is gone
            return f"the store ({self.source.where}) did not answer ({exc})"
        if raw is None:
            return "no knock record (no newcomer started at this slot yet)"
        try:
            fields = json.loads(book.decode(slot, raw).value)
            address, record = str(fields["address"]), str(fields["id"])
        except (IntegrityError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(
                f"the store value at key {name!r} (the knock record of the newcomer at slot {slot}) was tampered "
                f"with: {exc}. Someone other than the job's ranks writes to the store: set a job secret and keep "
                f"the store's port unreachable (docs/security.md)") from None
        if record in used:
            return (f"its knock record (id {record[:8]}) was used by an earlier grow: the newcomer that wrote it "
                    f"joined already, or died after; a new newcomer at this slot writes a fresh one")
        return lineage.Found(address, record)

    def hosts(self, slot: int) -> list[str]:
        return [self._host]

    @contextlib.contextmanager
    def waiting(self, slot: int) -> Iterator[tcp.Listener]:
        listener = tcp.Listener(self._host, 0)
        book = self._book(slot)
        try:
            text = json.dumps({"address": tcp.format_address(listener.getsockname()[:2]), "id": os.urandom(16).hex()})
            try:
                mine = book.publish(text)
            except Exception as exc:
                raise DistributedError(f"slot {slot}: cannot write this newcomer's knock record to the store "
                                       f"({self.source.where}): {exc}") from None
            log.debug("slot %d: knocked at store key %r", slot, book.key_name(slot))
            with book.defended(mine):  # an outsider's overwrite is put back while the members look
                yield listener
            with contextlib.suppress(Exception):  # taken in or given up: nobody should find it again
                if store_records.read(self._store, book.key_name(slot)) == mine:
                    self._store.delete_key(book.key_name(slot))
        finally:
            listener.close()
