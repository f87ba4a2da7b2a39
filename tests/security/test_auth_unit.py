"""The job secret's settings, the handshake between two real sockets, the bounds of the JACCL
side channel against a peer that does know the secret, and the verify modes' tags."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
import tracemalloc

import pytest

from adapter.backends.jaccl.side_channel import SideChannel
from adapter.backends.transport import auth, tcp
from adapter.errors import ConfigError, PeerError


def test_secret_from_environment_and_file(monkeypatch, tmp_path):
    monkeypatch.delenv("JACKLRING_SECRET", raising=False)
    monkeypatch.delenv("JACKLRING_SECRET_FILE", raising=False)
    assert auth.job_secret() is None
    monkeypatch.setenv("JACKLRING_SECRET", "ab" * 32)
    assert auth.job_secret() == bytes.fromhex("ab" * 32)
    monkeypatch.setenv("JACKLRING_SECRET", "short")
    with pytest.raises(ConfigError, match="too short"):
        auth.job_secret()
    monkeypatch.delenv("JACKLRING_SECRET")
    path = tmp_path / "secret"
    path.write_text("cd" * 32)
    path.chmod(0o644)
    monkeypatch.setenv("JACKLRING_SECRET_FILE", str(path))
    with pytest.raises(ConfigError, match="readable by other users"):
        auth.job_secret()
    path.chmod(0o600)
    assert auth.job_secret() == bytes.fromhex("cd" * 32)


def test_a_weak_passphrase_is_refused_and_a_strong_one_accepted(monkeypatch):
    monkeypatch.delenv("JACKLRING_SECRET_FILE", raising=False)
    # 29 characters of dictionary words: version 2 took it, and a dictionary found it in 1.6 s
    monkeypatch.setenv("JACKLRING_SECRET", "correct horse battery staple!")
    with pytest.raises(ConfigError, match="weak passphrase"):
        auth.job_secret()
    strong = "gentle-Orbit-7734-quarry-Lantern-fable-9023-mosaic-tundra"
    monkeypatch.setenv("JACKLRING_SECRET", strong)
    assert auth.job_secret() == strong.encode()


def test_the_key_is_stretched_once_per_secret_and_salt():
    first = auth.auth_from_secret(b"z" * 32, b"addresses")
    t0 = time.perf_counter()
    assert auth.auth_from_secret(b"z" * 32, b"addresses") == first  # cached
    assert time.perf_counter() - t0 < 0.01
    assert auth.auth_from_secret(b"z" * 32, b"other addresses") != first


def test_only_a_secret_in_the_launchers_drawn_form_skips_the_stretch(monkeypatch):
    from jacklring_shared.secret_text import DRAWN_PREFIX
    from launcher.environment import job_secret as launcher_secret

    monkeypatch.delenv("JACKLRING_SECRET", raising=False)
    monkeypatch.delenv("JACKLRING_SECRET_FILE", raising=False)
    drawn = launcher_secret({}, {})
    assert drawn.startswith(DRAWN_PREFIX) and len(drawn) == len(DRAWN_PREFIX) + 64
    assert launcher_secret({}, {}) != drawn  # fresh bits every job
    value = bytes.fromhex(drawn[len(DRAWN_PREFIX):])
    monkeypatch.setenv("JACKLRING_SECRET", drawn)
    assert auth.configured_secret() == auth.Secret(value, drawn=True)
    assert auth.job_secret() == value
    salt = b"the ring's addresses"
    key = auth.job_auth(b"context", salt=salt)
    assert key.secret and key == auth.auth_from_secret(value, salt, drawn=True)
    assert key != auth.auth_from_secret(value, salt)  # the stretched key of the same bytes
    assert auth.auth_from_secret(value, b"other addresses", drawn=True) != key
    # The same bits set by a user, in hex: stretched, as every user-set secret is.
    monkeypatch.setenv("JACKLRING_SECRET", value.hex())
    assert auth.configured_secret() == auth.Secret(value, drawn=False)
    assert auth.job_auth(b"context", salt=salt) == auth.Auth(auth._stretched_key(value, salt), True)
    for bad in (DRAWN_PREFIX + "ab" * 31, DRAWN_PREFIX + "ab" * 33, DRAWN_PREFIX + "zz" * 32, DRAWN_PREFIX):
        monkeypatch.setenv("JACKLRING_SECRET", bad)
        with pytest.raises(ConfigError, match="hex digits"):
            auth.job_secret()


def test_require_auth_refuses_a_job_without_a_secret(monkeypatch):
    monkeypatch.delenv("JACKLRING_SECRET", raising=False)
    monkeypatch.delenv("JACKLRING_SECRET_FILE", raising=False)
    monkeypatch.setenv("JACKLRING_REQUIRE_AUTH", "1")
    with pytest.raises(ConfigError, match="JACKLRING_REQUIRE_AUTH=1"):
        auth.job_auth(b"ctx")
    monkeypatch.setenv("JACKLRING_SECRET", "ef" * 32)
    assert auth.job_auth(b"ctx").secret


def _pair(server_key, client_key, token=7, client_token=7):
    lst = tcp.Listener("127.0.0.1", 0, local=False)
    lst.serve(server_key, token, 0, lambda h: None, "unit")
    try:
        hello = tcp.Hello(1, 1, 0, 0, client_token)
        return tcp.connect(lst.getsockname()[:2], hello, time.monotonic() + 5, "rank 0", client_key), lst
    except BaseException:
        lst.close()
        raise


@pytest.mark.timeout(30)
def test_both_sides_must_know_the_key():
    good, bad = auth.auth_from_secret(b"a" * 32), auth.auth_from_secret(b"b" * 32)
    sock, lst = _pair(good, good)
    taken = lst.take(lambda h: True, time.monotonic() + 5, "rank 1")
    assert taken is not None and taken[1].sender == 1
    sock.close()
    taken[0].close()
    lst.close()
    with pytest.raises(PeerError, match="did not prove the job secret"):
        _pair(good, bad)
    with pytest.raises(PeerError, match="another job"):
        _pair(good, good, token=7, client_token=8)


@pytest.mark.timeout(30)
def test_side_channel_refuses_an_oversized_length_from_an_authenticated_peer():
    key = auth.auth_from_secret(os.urandom(32))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    outcome = {}

    def rank0():
        try:
            side = SideChannel(0, 2, ("127.0.0.1", port), 5, time.monotonic() + 10, key)
            tracemalloc.start()
            try:
                side.all_gather(b"x")
            except PeerError as exc:
                outcome["error"] = str(exc)
            outcome["peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            side.close()
        except Exception as exc:  # reported below
            outcome["error"] = f"unexpected {exc!r}"
    thread = threading.Thread(target=rank0)
    thread.start()
    sock = tcp.connect(("127.0.0.1", port), tcp.Hello(0x4A43, 1, 0, 0, 5), time.monotonic() + 10, "rank 0", key)
    sock.sendall(struct.pack("<I", 0xFFFFFFF0))
    thread.join(10)
    sock.close()
    assert "announced a 4294967280-byte side-channel frame" in outcome.get("error", ""), outcome
    assert outcome["peak"] < 1 << 20


def test_store_ring_key_comes_from_the_secret_or_else_through_the_store(monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    from adapter.rendezvous.store_ring import store_auth
    from adapter.rendezvous.store_secret import ring_salt
    monkeypatch.delenv("JACKLRING_SECRET", raising=False)
    monkeypatch.delenv("JACKLRING_SECRET_FILE", raising=False)
    store = dist.HashStore()
    first, second = store_auth(store, "g/0/", 0), store_auth(store, "g/0/", 1)
    assert first == second and first.secret
    assert store_auth(store, "g/1/", 0) != first  # a fresh key per group incarnation
    # A newcomer for slot 0 (the store outlived rank 0: torchrun's agent serves it) reads the
    # members' key: one that drew its own overwrote theirs, and its knock record failed their MAC.
    assert store_auth(store, "g/0/", 0, joining=True) == first == store_auth(store, "g/0/", 1)
    monkeypatch.setenv("JACKLRING_REQUIRE_AUTH", "1")
    with pytest.raises(ConfigError, match="only as safe as the store"):
        store_auth(store, "g/2/", 0)
    monkeypatch.setenv("JACKLRING_SECRET", "12" * 32)
    salted = auth.auth_from_secret(bytes.fromhex("12" * 32), ring_salt(None))
    assert store_auth(store, "g/3/", 0) == salted != auth.auth_from_secret(bytes.fromhex("12" * 32))
    assert not store.check(["g/3/key"])  # the secret never goes into the store
