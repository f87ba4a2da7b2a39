"""Shared memory between the ranks of a group that run on one host (Linux): which ranks share a
host, and forming their segment.

One segment per host with several ranks of the group (the whole group, or some of its ranks when
the group spans hosts): a memfd created by the host's first rank and opened by the others through
/proc/<pid>/fd/<n> (only processes allowed to inspect that rank, i.e. the same user, can), so the
segment never has a name in /dev/shm and the kernel frees it when the last rank exits, kill -9
included. The segment's layout, steps, waits and liveness checks are the native engine's
(local/segment.py, csrc/shm).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable

from . import engine
from .segment import MAX_RANKS, SharedGroup

log = logging.getLogger("jacklring.shm")

RECORD_BYTES = 512              # fixed-size records exchanged while forming the group


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _inode(path: str) -> str:
    try:
        st = os.stat(path)
        return f"{st.st_dev}:{st.st_ino}"
    except OSError:
        return ""


def host_identity() -> dict:
    """What must be equal for two processes to share memory and see each other's pids and
    abstract sockets: the same kernel boot, host name, pid and network namespaces, user."""
    return {
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "host": socket.gethostname(),
        "pidns": _inode("/proc/self/ns/pid"),
        "netns": _inode("/proc/self/ns/net"),
        "shm": _inode("/dev/shm"),
        "uid": os.getuid(),
    }


def unusable_here() -> str | None:
    """Why this process cannot take part in a shared-memory group, or None."""
    if sys.platform != "linux":
        return "shared memory is implemented for Linux only"
    if not hasattr(os, "pidfd_open") or not hasattr(os, "memfd_create"):
        return "this Python has no os.pidfd_open / os.memfd_create"
    why = engine.why_missing()
    if why:
        return why
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        return f"pidfd_open is unavailable ({exc.strerror})"
    return None


def _pack(record: dict) -> bytes:
    raw = json.dumps(record).encode()
    if len(raw) > RECORD_BYTES:
        raise ValueError(f"shared-memory set-up record too long ({len(raw)} bytes)")
    return raw.ljust(RECORD_BYTES, b"\0")


def _unpack(raw: bytes) -> dict:
    return json.loads(bytes(raw).rstrip(b"\0"))


@dataclass
class Placement:
    """Where a group's ranks are, as shared memory sees it, and this rank's segment."""
    hosts: list[list[int]]          # the ranks of each host in rank order, hosts by their first rank
    group: "SharedGroup | None"     # the segment of this rank's host, when it shares memory
    shared: bool                    # whether every host with several ranks shares memory (same everywhere)


def form(rank: int, size: int, gather: Callable[[bytes], list[bytes]], chunk_bytes: int,
         wanted: bool, describe: Callable[[bytes], str] = bytes.hex,
         mismatch: Callable[[int, int, bytes, bytes], str] | None = None) -> Placement:
    """Collectively decide whether the ranks that are on one host share memory and, if so,
    attach them: one segment per host with several ranks, created by its first rank.

    gather(record) exchanges RECORD_BYTES-byte records among all ranks (every rank calls form with
    the same arguments). The decision is the same on every rank: all hosts share memory or none
    does (shared=False, no group anywhere) when any rank cannot or does not want to.
    describe(header) words a collective's header in mismatch messages: the backend's format;
    mismatch(rank, peer, mine, theirs), when given, words the whole message instead (ranks of
    the whole group, both headers)."""
    why = None if wanted else "not wanted"
    why = why or unusable_here()
    ident = host_identity()
    records = [_unpack(r) for r in gather(_pack({"ok": why is None, "id": ident, "why": why}))]
    hosts = _by_host([r["id"] for r in records])
    nothing = Placement(hosts, None, False)
    if not all(r["ok"] for r in records):
        if wanted and engine.why_missing() and any(len(members) > 1 for members in hosts):
            engine.warn_missing_once(rank)
        reasons = {f"rank {q}: {r['why']}" for q, r in enumerate(records) if not r["ok"]}
        log.debug("rank %d: no shared memory (%s)", rank, "; ".join(sorted(reasons)))
        return nothing
    if all(len(members) == 1 for members in hosts):
        log.debug("rank %d: no shared memory: no two ranks are on one host", rank)
        return nothing
    if max(len(members) for members in hosts) > MAX_RANKS:
        log.debug("rank %d: no shared memory: more than %d ranks on one host", rank, MAX_RANKS)
        return nothing
    members = next(m for m in hosts if rank in m)
    local = members.index(rank)
    total = SharedGroup.segment_bytes(len(members), chunk_bytes)
    fd = -1
    record: dict = {"ok": True, "pid": os.getpid()}
    try:
        if local == 0 and len(members) > 1:
            fd = os.memfd_create("jacklring-shm", os.MFD_CLOEXEC)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, total)
            record.update(path=f"/proc/{os.getpid()}/fd/{fd}")
    except OSError as exc:
        record = {"ok": False, "why": f"rank {rank} cannot create the segment: {exc.strerror or exc}"}
    group = None
    try:
        second = [_unpack(r) for r in gather(_pack(record))]
        first = second[members[0]]
        mine: dict = {"ok": all(r["ok"] for r in second)}
        if mine["ok"] and len(members) > 1:
            try:
                group = SharedGroup(local, len(members), chunk_bytes, first["path"] if local else fd,
                                    [second[q]["pid"] for q in members], members, describe, mismatch)
            except Exception as exc:  # whatever it is, every rank must still reach the last exchange
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                mine = {"ok": False, "why": f"rank {rank} cannot attach: {why}"}
        third = [_unpack(r) for r in gather(_pack(mine))]
    finally:
        if fd >= 0:
            os.close(fd)  # the mappings keep the memory alive; nothing else refers to it now
    if not all(r["ok"] for r in third):
        if group is not None:
            group.close()
        reasons = {r.get("why", "?") for r in second + third if not r["ok"]}
        log.warning("rank %d: shared memory could not be set up (%s); using sockets", rank, "; ".join(sorted(reasons)))
        return nothing
    return Placement(hosts, group, True)


def _by_host(identities: list[dict]) -> list[list[int]]:
    hosts: dict[str, list[int]] = {}
    for q, ident in enumerate(identities):
        hosts.setdefault(json.dumps(ident, sort_keys=True), []).append(q)
    return list(hosts.values())  # insertion order: by first rank
