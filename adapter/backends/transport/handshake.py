"""The connection handshake: who is connecting, why, and proof that both ends belong to the job.

    connector -> acceptor  HELLO      magic, version, purpose, sender, receiver, channel, job context, nonce_c
    acceptor -> connector  CHALLENGE  magic, status, nonce_s
    connector -> acceptor  PROOF      HMAC(key, "C" | HELLO | nonce_s)
    acceptor -> connector  ACK        magic, status, HMAC(key, "A" | HELLO | nonce_s | PROOF | status)
                                      (status OK only; a bad proof gets BAD_PROOF and no MAC)

Each side proves the key over a nonce the other side just chose, so neither a recorded
handshake nor a relay that does not know the key gets through, and a connection counts on
either side only once both proofs checked (the connector waits for the ACK). The connector
proves first and the acceptor computes its MAC only over a proof that checked: anyone may
connect to a listener, and no MAC of the key must ever reach them (it would let them test
guesses of the secret offline, as version 2 did). The connector's proof does reach whatever
listens where it connects, a squatter included; that is why a user-set secret is stretched with scrypt
and passphrases must be strong (auth.py). Both nonces,
known to both ends when it is done (Hello.session), key the connection's message MACs
(integrity.for_link), so no two connections share those keys. Every frame has a
fixed size: there is no length field to lie about.

The acceptor's half runs in acceptor.py.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
import time
from dataclasses import dataclass, field, replace

from ...errors import PeerError
from .auth import MAC_BYTES, NONCE_BYTES, Auth, equal

HELLO = struct.Struct(f"<4sHHiiiQ{NONCE_BYTES}s")
CHALLENGE = struct.Struct(f"<4sB{NONCE_BYTES}s")
PROOF_BYTES = MAC_BYTES
ACK = struct.Struct(f"<4sB{MAC_BYTES}s")
MAGIC, CHALLENGE_MAGIC, ACK_MAGIC = b"JKLR", b"JKLC", b"JKLA"
VERSION = 3   # 2 answered any HELLO with a MAC of the key

OK, OTHER_JOB, UNEXPECTED, BAD_PROOF, ALIVE, NOT_NOW = 0, 1, 2, 3, 4, 5
# A liveness probe (transport/blame.py): the acceptor answers its HELLO with a CHALLENGE of
# status ALIVE and closes, nothing queued or logged. The acceptor thread answering proves the
# process runs (a stopped one's kernel accepts for it, nobody answers; a dead one refuses).
PURPOSE_PROBE = 0x5052  # "PR"
STATUS_TEXT = {OTHER_JOB: "it belongs to another job (different job context)",
               UNEXPECTED: "it was not expected there (wrong rank, purpose or connection)",
               BAD_PROOF: "it did not prove the job secret",
               NOT_NOW: "the group holds this address, but takes nobody in now (no grow in progress)"}

HANDSHAKE_TIMEOUT_S = 1.0    # acceptor: a real peer finishes in milliseconds
ANSWER_TIMEOUT_S = 5.0       # connector: how long a listener may stay silent before it is called foreign
MAX_CLOSED_RETRIES = 20      # listener closes our connection before answering: retried this often


@dataclass(frozen=True)
class Hello:
    purpose: int
    sender: int
    receiver: int
    channel: int
    token: int                      # the job context id (auth.context_id), in the clear
    nonce: bytes = field(default=bytes(NONCE_BYTES), compare=False, repr=False)
    # The acceptor's nonce, known to both ends once the handshake is done (not in the frame).
    server_nonce: bytes = field(default=b"", compare=False, repr=False)

    @property
    def session(self) -> bytes:
        """Both handshake nonces: what no other connection shares, even one of the same job,
        ranks and purpose (a key derived from it is this connection's alone)."""
        return self.nonce + self.server_nonce

    def pack(self) -> bytes:
        return HELLO.pack(MAGIC, VERSION, self.purpose, self.sender, self.receiver, self.channel,
                          self.token, self.nonce)

    def fresh(self) -> "Hello":
        return Hello(self.purpose, self.sender, self.receiver, self.channel, self.token, os.urandom(NONCE_BYTES))


def parse_hello(data: bytes) -> Hello | None:
    if len(data) != HELLO.size:
        return None
    magic, version, purpose, sender, receiver, channel, token, nonce = HELLO.unpack(data)
    if magic != MAGIC or version != VERSION:
        return None
    return Hello(purpose, sender, receiver, channel, token, nonce)


# ---- connector side -----------------------------------------------------------------------------

class HandshakeRetry(Exception):
    """The listener closed the connection before answering (it may be shedding load): try again."""


class NotNow(PeerError):
    """The listener is this job's, holding an address the group will need (a JACCL coordinator
    between grows), and takes nobody in now: a newcomer knocks again later. Refused at the
    HELLO, so the connector sent no proof."""


class OtherJob(PeerError):
    """The listener is a jacklring rank of another job context: often this job's peer still in
    an earlier incarnation of the group (it has not closed and re-formed yet), so the connector
    tries again until its deadline."""


def _recv_fixed(sock: socket.socket, size: int, timeout_at: float, magic: bytes) -> bytes:
    """Up to size bytes; fewer when the peer closes, or as soon as they cannot start with magic
    (a foreign service is named at once). A reset after some bytes counts as a close."""
    data = bytearray()
    while len(data) < size:
        remaining = timeout_at - time.monotonic()
        if remaining <= 0:
            raise socket.timeout()
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(size - len(data))
        except ConnectionResetError:
            if data:
                break
            raise
        if not chunk:
            break
        data += chunk
        if data[:len(magic)] != magic[:len(data)]:
            break
    return bytes(data)


def client_handshake(sock: socket.socket, hello: Hello, auth: Auth, where: str, who: str,
                     answer_timeout: float = ANSWER_TIMEOUT_S, deadline: float | None = None) -> Hello:
    """Run the connector's half on a connected socket; returns hello with the acceptor's nonce.
    PeerError (final) when the listener is not a rank of this job or refuses this rank;
    HandshakeRetry when it closed without a word. The answer is awaited answer_timeout (shrink()
    passes a short one), or until the caller's deadline when that comes first: a stopped rank's
    kernel accepts for it, nobody answers."""
    hello_bytes = hello.pack()
    answer_s = answer_timeout if deadline is None else max(0.01, min(answer_timeout, deadline - time.monotonic()))
    try:
        sock.settimeout(answer_s)
        sock.sendall(hello_bytes)
        answer = _recv_fixed(sock, CHALLENGE.size, time.monotonic() + answer_s, CHALLENGE_MAGIC)
    except socket.timeout:
        if answer_s < answer_timeout:
            silent = PeerError(f"{who} at {where} accepted the connection but did not answer the jacklring "
                               f"handshake before the deadline (stopped, or too busy to answer)")
            # Its acceptor thread (which answers whatever its main thread does) said nothing for
            # the whole deadline: it is the silent one, and it will send no notice either.
            silent.unanswered = True  # type: ignore[attr-defined]
            raise silent from None
        raise PeerError(f"the process listening on {where} (expected: {who}) accepted the connection but did "
                        f"not answer the jacklring handshake within {answer_s:.3g} s; another program "
                        f"listens on that address, or the rank is stopped") from None
    except OSError as exc:
        if exc.errno in (errno.ECONNRESET, errno.EPIPE):
            raise HandshakeRetry(exc.strerror or str(exc)) from None
        raise
    if not answer:
        raise HandshakeRetry("the listener closed the connection before answering the handshake")
    if len(answer) < CHALLENGE.size or answer[:4] != CHALLENGE_MAGIC:
        raise PeerError(f"the process listening on {where} (expected: {who}) is not a jacklring rank: it "
                        f"answered the handshake with {answer[:16].hex() or 'nothing'}")
    _, status, nonce_s = CHALLENGE.unpack(answer)
    if status != OK:
        refusal = OtherJob if status == OTHER_JOB else NotNow if status == NOT_NOW else PeerError
        raise refusal(f"{who} at {where} refused this connection: {STATUS_TEXT.get(status, f'status {status}')}")
    proof = auth.mac(b"C", hello_bytes, nonce_s)
    try:
        sock.sendall(proof)
        ack_s = answer_s if deadline is None else max(0.01, min(answer_s, deadline - time.monotonic()))
        sock.settimeout(ack_s)
        ack = _recv_fixed(sock, ACK.size, time.monotonic() + ack_s, ACK_MAGIC)
    except socket.timeout:
        raise PeerError(f"{who} at {where} did not acknowledge the handshake within {ack_s:.3g} s") from None
    except OSError as exc:
        if exc.errno in (errno.ECONNRESET, errno.EPIPE):
            raise HandshakeRetry(exc.strerror or str(exc)) from None
        raise
    if not ack:
        raise HandshakeRetry("the listener closed the connection before acknowledging the handshake")
    if len(ack) < ACK.size:
        raise PeerError(f"{who} at {where} sent a malformed handshake acknowledgement ({ack[:8].hex()})")
    magic, status, mac_a = ACK.unpack(ack)
    if magic == ACK_MAGIC and status == BAD_PROOF:  # unauthenticated: a refusal carries no MAC
        raise PeerError(f"{who} at {where} refused this rank's proof: this rank did not prove the job secret "
                        f"it holds there (were the ranks given different job secrets?)")
    if magic != ACK_MAGIC or status != OK or not equal(mac_a, auth.mac(b"A", hello_bytes, nonce_s, proof,
                                                                       bytes([status]))):
        raise PeerError(f"the process listening on {where} (expected: {who}) did not prove the job secret: a "
                        f"process outside this job listens there, or the ranks were given different secrets")
    return replace(hello, server_nonce=nonce_s)


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", raw)[1]
