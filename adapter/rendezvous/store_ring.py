"""A ring formed through a key-value store (torch's TCPStore, under torchrun, Slurm or a torch
process group): every rank publishes its listening address in an authenticated record and reads
everyone's (store_records), under a key derived from a secret outsiders cannot read where the
job gives one (store_secret). Needs a torch store object, not torch.distributed itself. A
newcomer (JACKLRING_JOIN=1) joins such a ring with join_store_ring, through store_grow's origin."""
from __future__ import annotations

import functools
import ipaddress
import logging
import os
import socket
from typing import Callable

from .. import config
from ..backends.base import Backend
from ..backends.transport import auth, tcp
from ..errors import LINK, ConfigError, DistributedError, IntegrityError, PeerError, with_failure
from . import store_grow, store_records, store_secret

log = logging.getLogger("jacklring.torch")

KEY_PREFIX = "jacklring/addr/"
ENV_HOST = "JACKLRING_TORCH_HOST"


def store_ring(store, rank: int, size: int, timeout_s: float, scope: str = "",
               growth: "store_grow.StoreSource | str | None" = None) -> Backend:
    """Every rank listens on a free port, publishes ip:port in the store, reads everyone's.

    Each rank's record is MACed under the job key and bound to its key name, so a value an
    outsider wrote is reported as tampering (store_records). The ring's connections prove the
    job secret (JACKLRING_SECRET / _FILE) when one is set; otherwise rank 0 of the group draws
    a random key and hands it over through the store, so the store is the trust root: whoever
    can read it can join (docs/security.md). scope names the group on this store (the same on
    every member); the formation's keys are tagged without any counter in the store.

    growth: where newcomers reach the store, so the ring can grow (store_grow: they knock
    there), or why it cannot (a torch process group's store), named by grow()."""
    from ..backends.ring import lineage
    from ..backends.ring.backend import RingBackend
    from ..config import connect_timeout

    host = listen_host(store)
    listener = tcp.Listener(host, 0)  # TCP, plus a Unix socket that same-host peers use
    try:
        mine = tcp.format_address(listener.getsockname()[:2])
        prefix = formation_prefix(scope, size)
        wait_s = min(timeout_s, connect_timeout())
        try:
            job = store_auth(store, prefix, rank, wait_s, host)
            book = store_records.RecordBook(store, prefix, job, rank, size)
            record = book.publish(mine)
            try:
                records = book.gather(record, wait_s)
                # before any rank dials an address: did every rank read this run's records? (this
                # rank's record kept in place meanwhile, for peers still reading it)
                told = functools.partial(store_records.told_tampering, store, prefix, job, rank, size)
                with book.defended(record):
                    seals, sealed = store_records.seal(store, prefix, job, rank, records, wait_s, book.key_name,
                                                       watch=lambda missing: _left(rank, records, missing, told))
            except IntegrityError as exc:  # peers waiting for this rank name the tampering, not its exit
                store_records.tell_tampering(store, prefix, job, rank, size, book.run, str(exc))
                raise
        except (DistributedError, ConfigError):
            raise
        except Exception as exc:  # the store itself is gone (its server's process ended)
            raise DistributedError(f"rank {rank}: jacklring rendezvous: the store closed while this rank "
                                   f"waited for every rank's address ({exc})") from None
        addresses = [[r.value] for r in records]
        log.debug("rank %d: jacklring ring addresses %s (formation %s)", rank, addresses, prefix)
        with book.defended(record), seals.defended(sealed):  # for peers still reading them
            # Each record was published with its rank's listener already open: a peer that then
            # refuses connections has left (an IntegrityError, a crash), and this rank says so
            # at once instead of retrying until the connect deadline.
            ring = RingBackend(rank, addresses, [listener], timeout_s, wait_s, job=job, peers_listening=True)
    except BaseException:
        listener.close()
        raise
    if isinstance(growth, store_grow.StoreSource):
        origin = store_grow.StoreOrigin(store, prefix, job, size, host, growth)
        lineage.record(ring, lineage.Lineage(origin, list(range(size))))
    else:
        lineage.refuse(ring, growth or "it was formed through a store that no newcomer is told how to reach")
    return ring


def _left(rank: int, records: list[store_records.Record], missing: list[int],
          told: "Callable[[int, str], str | None]") -> None:
    """PeerError naming the first rank that has not sealed and whose listener, open when it
    published its record, now refuses connections: it has left, and the seal would wait for it
    until the deadline. A bare connection that closes at once is what a live listener drops
    quietly (a liveness probe). A rank that left because it found a tampered record said so in
    the store (told(q, its nonce)): then an IntegrityError with its words."""
    for q in missing:
        try:
            with socket.create_connection(tcp.parse_address(records[q].value), timeout=0.2):
                continue
        except ConnectionRefusedError:
            verdict = told(q, records[q].run)
            if verdict is not None:
                raise IntegrityError(f"rank {rank}: jacklring rendezvous: rank {q} stopped forming: "
                                     f"{verdict}") from None
            error = PeerError(f"rank {rank}: rank {q} died while the group formed (it published its record "
                              f"listening, then refused connections before it confirmed the records it read)")
            raise with_failure(error, culprit=q, peer=q, how=LINK) from None
        except OSError:
            continue  # slow or unreachable: not evidence that it left


def formation_prefix(scope: str, size: int) -> str:
    """The store keys of this process's next formation of `scope` (see formation_tag): a
    newcomer computes its first formation's, which is the members' unless they formed the
    group more than once in their processes."""
    # A store can outlive a group (torch keeps one TCPStore server per port in a process and
    # names the groups of a new init like the old ones; torchrun's agent keeps its store over
    # restarts), so every formation's keys carry a tag every rank derives on its own.
    return f"{KEY_PREFIX}{store_records.formation_tag(f'{scope}/{size}')}/"


def store_auth(store, prefix: str, rank: int, wait_s: float = 120.0, listen_host: str = "127.0.0.1",
               joining: bool = False) -> auth.Auth:
    """The job secret when configured, else one derived from a 0600 file when every rank shares
    this host (store_secret), else a random key drawn by rank 0 and shared through the store
    (which every rank has already trusted with the rendezvous). That last one only where the
    ring listens on loopback or JACKLRING_ALLOW_UNAUTHENTICATED=1: a group spanning hosts
    without a secret is refused (ConfigError saying how to set one).

    joining: a newcomer's call (store_grow), which only reads the key, even at rank 0: where
    the store outlives slot 0 (torchrun's agent serves it) a newcomer for slot 0 that drew a
    key would overwrite the members' and knock under a key they do not hold."""
    job = store_secret.auth_for_store_ring(store_address(store), listen_host)
    if job is not None:
        return job
    if config.get("JACKLRING_REQUIRE_AUTH"):
        raise ConfigError("JACKLRING_REQUIRE_AUTH=1 but no job secret is set: a key shared through torch's "
                          "store is only as safe as the store (which has no authentication); set "
                          "JACKLRING_SECRET or JACKLRING_SECRET_FILE on every rank")
    key = f"{prefix}key"
    if rank == 0 and not joining:
        store.set(key, auth.generate_secret())
    text = store_records.wait_for(store, key, wait_s, rank, "group key from rank 0")
    try:
        value = bytes.fromhex(text.decode())
    except ValueError:
        value = b""
    if len(value) != auth.SECRET_BYTES:
        raise IntegrityError(f"rank {rank}: jacklring rendezvous: the store value at key {key!r} (rank 0's "
                             f"group key) was tampered with: not {auth.SECRET_BYTES} bytes of hex")
    return auth.auth_from_secret(value, drawn=True)  # 256 bits rank 0 drew


def listen_host(store) -> str:
    """JACKLRING_TORCH_HOST, else 127.0.0.1 when the rendezvous host is loopback, else the local
    address this machine uses to reach the rendezvous host."""
    explicit = config.get(ENV_HOST)
    if explicit:
        return explicit
    master = _rendezvous_host(store)
    if master is None:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(master, None, socket.AF_INET, socket.SOCK_STREAM)
        ip = infos[0][4][0]
    except OSError:
        return "127.0.0.1"
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    # Connecting a UDP socket sends nothing; it only asks the kernel for the route's source address.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 9))
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def _rendezvous_host(store) -> str | None:
    address = store_address(store)
    return address[0] if address is not None else (os.environ.get("MASTER_ADDR") or None)


def store_address(store) -> tuple[str, int] | None:
    """(host, port) of the TCPStore under any PrefixStores, or None (a FileStore, HashStore)."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            port = getattr(store, "port", None)
            return host, int(port) if isinstance(port, int) else 0
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def join_store_ring(store, slot: int, size: int, timeout_s: float, scope: str,
                    source: "store_grow.StoreSource") -> Backend:
    """As the newcomer at `slot` of a group of `size` formed through `store` (under `scope`, as
    store_ring was called): knock and wait up to JACKLRING_CONNECT_TIMEOUT to be taken in by
    the members' grow(); the grown ring's backend. The caller has refused slot 0 of a store
    served by rank 0 before opening it (engines: the store died with rank 0)."""
    from ..backends.ring import grow
    from ..backends.ring.backend import RingBackend
    from ..config import connect_timeout

    host = listen_host(store)
    prefix = formation_prefix(scope, size)
    wait_s = connect_timeout()
    try:
        job = store_auth(store, prefix, slot, min(timeout_s, wait_s), host, joining=True)
        origin = store_grow.StoreOrigin(store, prefix, job, size, host, source)
    except (DistributedError, ConfigError):
        raise
    except Exception as exc:
        raise DistributedError(f"slot {slot}: the store ({source.where}) closed while this newcomer read the job "
                               f"key ({exc})") from None
    return grow.join_ring(RingBackend, slot, origin, timeout_s, wait_s)
