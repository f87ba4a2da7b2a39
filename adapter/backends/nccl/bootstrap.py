"""How NCCL ranks agree before NCCL runs: the unique-id exchange and split plans.
Pure Python over opaque bytes, so it is tested without cupy or a GPU.

Exchange over TCP (the MLX environment contract): rank 0 listens on NCCL_HOST_IP:NCCL_PORT
and hands the id to every other rank, which connects with retries until the connect
deadline. Each connection opens with the authenticated handshake (purpose "NI", sender rank,
world size in the channel field; both ends prove the job key, see transport/auth.py); a stray,
garbage or unauthenticated connection is rejected and rank 0 keeps waiting.
A rank that announces a different world size, a rank out of range or a rank already served
gets an error frame naming the problem, so both sides fail with the same clear message.
(Through a torch store instead: adapter.rendezvous.nccl_id, where the id is a MACed record.)

Frames from rank 0: REPLY (magic, status, length) then `length` bytes: the id when status
is OK, else a UTF-8 error message. The fetching rank answers ACK so rank 0 knows the id
arrived whole before it counts that rank as served.
"""
from __future__ import annotations

import logging
import socket
import struct
import time
from typing import Callable

from ...errors import ConfigError, PeerError
from ..transport import auth, tcp

log = logging.getLogger("jacklring.nccl")

PURPOSE_NCCL_ID = 0x4E49  # "NI": rejects connections meant for other backends
REPLY = struct.Struct("<4sBI")
REPLY_MAGIC = b"NCID"
STATUS_OK, STATUS_ERROR = 0, 1
ACK = b"ACK!"
NCCL_ID_BYTES = 128          # NCCL_UNIQUE_ID_BYTES
MAX_SPLIT_ID_BYTES = NCCL_ID_BYTES
MAX_REPLY_BYTES = 4096       # an id (128 bytes) or a one-line error message


def id_auth(token: int) -> tcp.Auth:
    """The key of the id exchange: the job secret, else derived from the (public) token."""
    return auth.job_auth(f"nccl-id:{token}".encode(), "the NCCL id exchange")


def _where(host: str, port: int) -> str:
    return f"NCCL_HOST_IP:NCCL_PORT = {tcp.format_address((host, port))}"


def serve_id(listener: "socket.socket | tcp.Listener", world: int, unique_id: bytes, deadline: float,
             token: int = 0) -> None:
    """Rank 0: give unique_id to ranks 1..world-1 through listener, returning once all have it.

    Raises PeerError naming the ranks that never came (and the address they should use)."""
    if not isinstance(listener, tcp.Listener):
        adopted = tcp.Listener.adopt(listener)
        try:
            return serve_id(adopted, world, unique_id, deadline, token)
        finally:
            adopted.close()
    host, port = listener.getsockname()[:2]
    listener.serve(id_auth(token), token, 0,
                   lambda h: None if h.purpose == PURPOSE_NCCL_ID else f"unknown purpose {h.purpose:#x}",
                   "rank 0 (NCCL id)")
    waiting = set(range(1, world))
    while waiting:
        try:
            sock, hello = listener.take(lambda h: True, deadline, "every rank")  # type: ignore[misc]
        except PeerError as exc:
            rejected = str(exc).partition("; meanwhile")[2]
            missing = ", ".join(map(str, sorted(waiting)))
            raise PeerError(
                f"rank 0: rank(s) {missing} of {world} did not fetch the NCCL unique id from "
                f"{_where(host, port)} before the deadline (are they running with the same NCCL_HOST_IP "
                f"and NCCL_PORT?){'; meanwhile' + rejected if rejected else ''}") from None
        with sock:
            problem = _check_hello(hello, world, waiting)
            who = f"rank {hello.sender} (NCCL id fetch)"
            try:
                if problem:
                    log.warning("rank 0: refused rank %s: %s", hello.sender, problem)
                    _send_frame(sock, STATUS_ERROR, problem.encode(), deadline, who)
                    continue
                _send_frame(sock, STATUS_OK, unique_id, deadline, who)
                ack = bytearray(len(ACK))
                tcp.recv_exact(sock, memoryview(ack), deadline, f"rank 0: {who}")
            except (PeerError, OSError) as exc:
                # That rank died mid-fetch; it may retry, so keep waiting for it.
                log.warning("rank 0: serving the NCCL id to rank %s failed: %s", hello.sender, exc)
                continue
            if bytes(ack) == ACK:
                waiting.discard(hello.sender)


def _check_hello(hello: tcp.Hello, world: int, waiting: set[int]) -> str | None:
    if hello.channel != world:
        return (f"rank {hello.sender} says MLX_WORLD_SIZE={hello.channel} but rank 0 has "
                f"MLX_WORLD_SIZE={world}")
    if not 1 <= hello.sender < world:
        return f"rank {hello.sender} is out of range for MLX_WORLD_SIZE={world}"
    if hello.sender not in waiting:
        return f"rank {hello.sender} already fetched the NCCL id: two processes have MLX_RANK={hello.sender}"
    return None


def _send_frame(sock: socket.socket, status: int, payload: bytes, deadline: float, who: str) -> None:
    tcp.send_all(sock, REPLY.pack(REPLY_MAGIC, status, len(payload)) + payload, deadline, who)


def fetch_id(host: str, port: int, rank: int, world: int, deadline: float, token: int = 0) -> bytes:
    """Rank > 0: the unique id from rank 0 at host:port, retrying the connection until deadline."""
    who = f"rank 0 ({_where(host, port)})"
    hello = tcp.Hello(PURPOSE_NCCL_ID, rank, 0, world, token)
    try:
        sock = tcp.connect((host, port), hello, deadline, who, id_auth(token))
    except PeerError as exc:
        raise PeerError(f"rank {rank}: {exc}; is rank 0 running and reachable?") from None
    with sock:
        head = bytearray(REPLY.size)
        tcp.recv_exact(sock, memoryview(head), deadline, f"rank {rank}: {who}")
        magic, status, length = REPLY.unpack(head)
        if magic != REPLY_MAGIC or length > MAX_REPLY_BYTES:
            raise PeerError(f"rank {rank}: {who} answered with something that is not a jacklring NCCL id "
                            f"(first bytes {bytes(head).hex()}); is another service on that port?")
        body = bytearray(length)
        tcp.recv_exact(sock, memoryview(body), deadline, f"rank {rank}: {who}")
        if status != STATUS_OK:
            raise ConfigError(f"rank {rank}: rank 0 refused to hand out the NCCL id: {body.decode(errors='replace')}")
        tcp.send_all(sock, ACK, deadline, f"rank {rank}: {who}")
        return bytes(body)


def exchange_id(rank: int, world: int, host: str, port: int, make_id: Callable[[], bytes],
                connect_timeout: float, token: int = 0) -> bytes:
    """Every rank's copy of one unique id: rank 0 makes and serves it, the others fetch it."""
    deadline = time.monotonic() + connect_timeout
    if rank == 0:
        unique_id = make_id()
        if world > 1:
            try:
                listener = tcp.Listener(host, port, local=False)
            except PeerError as exc:
                raise PeerError(f"rank 0: {exc} (set NCCL_HOST_IP to an address of rank 0's host)") from None
            try:
                serve_id(listener, world, unique_id, deadline, token)
            finally:
                listener.close()
        return unique_id
    return fetch_id(host, port, rank, world, deadline, token)


# ---- the unique id as cupy wants it ---------------------------------------------------------

def id_to_bytes(unique_id) -> bytes:
    """cupy >= 13 returns bytes; older versions a tuple of 128 signed chars."""
    if isinstance(unique_id, (bytes, bytearray)):
        return bytes(unique_id)
    return bytes(int(c) & 0xFF for c in unique_id)


def id_as_tuple(raw: bytes) -> tuple[int, ...]:
    """The old cupy form: signed chars."""
    return tuple(b - 256 if b > 127 else b for b in raw)


# ---- split -----------------------------------------------------------------------------------

def plan_split(records: list[tuple[int, int]], rank: int) -> tuple[list[int], int]:
    """From every rank's (color, key), the parent ranks of this rank's new group ordered by
    (key, parent rank), and this rank's position in it. Its first member is the group's leader."""
    color = records[rank][0]
    members = sorted((key, r) for r, (c, key) in enumerate(records) if c == color)
    order = [r for _, r in members]
    return order, order.index(rank)
