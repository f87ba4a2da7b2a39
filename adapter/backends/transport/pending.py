"""One connection in its handshake at a listener's acceptor (acceptor.py): what has arrived,
what is awaited, by when, and where it came from (its budget's source; whether it is served on
probation, its source being over that budget)."""
from __future__ import annotations

import socket

from .auth import Auth
from .handshake import HELLO, Hello


class Pending:
    __slots__ = ("sock", "peer", "expires", "buf", "need", "hello", "hello_bytes", "nonce_s", "key", "checking",
                 "source", "probation")

    def __init__(self, sock: socket.socket, peer: str, expires: float, source: object = None,
                 probation: bool = False) -> None:
        self.sock, self.peer, self.expires = sock, peer, expires
        self.buf = bytearray()
        self.need = HELLO.size
        self.hello: Hello | None = None
        self.hello_bytes = b""
        self.nonce_s = b""
        self.key: Auth | None = None   # a layout check's key (None: the job's)
        self.checking = False          # authenticated layout check: its frame is awaited
        self.source = source           # whose handshake budget it was counted against
        self.probation = probation     # its source was over budget: evicted first


def describe(addr) -> str:
    """A peer's address as errors and logs name it."""
    if isinstance(addr, tuple):
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return "a local process (Unix socket)"
