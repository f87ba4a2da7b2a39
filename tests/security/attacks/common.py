"""What an outsider can compute from public information (standard library only): the
handshake frames of old and new jacklring versions with the tokens that follow from the
job's addresses (visible in ss, /proc/net/unix or a predictable port), and a key derived
from the same facts. It never has the job secret."""
import hashlib
import hmac
import json
import os
import socket
import struct
import zlib

OLD_HELLO = struct.Struct("<4sHHiiiQ")
NEW_HELLO = struct.Struct("<4sHHiiiQ32s")


def ring_context(addresses):
    return json.dumps(addresses).encode()


def ring_context_v2(addresses, incarnation):
    """Today's ring context: the addresses and how many rings the process formed (1 for the first)."""
    return json.dumps([addresses, incarnation]).encode()


def jaccl_context(coordinator, devices):
    return json.dumps([coordinator, devices]).encode()


def jaccl_context_v2(coordinator, devices, incarnation):
    """Today's JACCL context: with how many groups the process formed (1 for the first)."""
    return json.dumps([coordinator, devices, incarnation]).encode()


def old_ring_token(addresses):
    return int.from_bytes(hashlib.sha256(ring_context(addresses)).digest()[:8], "little")


def old_jaccl_token(coordinator, devices):
    return zlib.crc32(jaccl_context(coordinator, devices))


def old_hello(purpose, sender, receiver, channel, token):
    return OLD_HELLO.pack(b"JKLR", 1, purpose, sender, receiver, channel, token)


def public_token(context):
    return int.from_bytes(hashlib.sha256(b"jacklring-context\0" + context).digest()[:8], "little")


def v2_hello(purpose, sender, receiver, channel, token):
    """Version 2's HELLO: its acceptor answered it with a MAC of the job key before any proof."""
    return NEW_HELLO.pack(b"JKLR", 2, purpose, sender, receiver, channel, token, os.urandom(32))


def new_handshake(sock, purpose, sender, receiver, channel, context, token=None):
    """Run today's handshake (version 3) with the best key public facts give; returns what happened."""
    if token is None:
        token = public_token(context)
    key = hashlib.sha256(b"jacklring-v2 public key\0" + context).digest()
    hello = NEW_HELLO.pack(b"JKLR", 3, purpose, sender, receiver, channel, token, os.urandom(32))
    sock.sendall(hello)
    answer = recv_n(sock, 37)
    if len(answer) < 37:
        return f"closed after {len(answer)} bytes"
    status, nonce_s = answer[4], answer[5:37]
    if status:
        return f"refused with status {status}"
    proof = hmac.new(key, b"C" + hello + nonce_s, hashlib.sha256).digest()
    sock.sendall(proof)
    ack = recv_n(sock, 37)
    if len(ack) < 37:
        return "closed before acknowledging"
    expected = hmac.new(key, b"A" + hello + nonce_s + proof + bytes([ack[4]]), hashlib.sha256).digest()
    return f"ack status {ack[4]} (server proof matched the public key: {hmac.compare_digest(expected, ack[5:37])})"


def recv_n(sock, n):
    data = b""
    sock.settimeout(5)
    try:
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


def connect(address, timeout=10.0):
    import time
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=2)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
