"""Ports the launcher and the tests choose lie below the kernel's ephemeral range, so no
outgoing connection can take one as its source port before the rank binds it."""
from __future__ import annotations

import socket

from jacklring_shared import ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = ports.ephemeral_range()
    chosen = ports.free_ports(["127.0.0.1"] * 8)
    assert len(set(chosen)) == 8
    assert all(ports.LOWEST <= p < low for p in chosen), (chosen, low)
    for p in chosen:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_skipped(monkeypatch) -> None:
    held_port, spare = ports.free_ports(["127.0.0.1"] * 2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", held_port))
        held.listen()
        draws = iter([held_port, held_port, spare])
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(draws))
        assert ports.free_ports(["127.0.0.1"]) == [spare]


def test_an_unreadable_range_falls_back_to_linuxs_default(tmp_path) -> None:
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_a_port_held_on_another_loopback_address_is_skipped(monkeypatch) -> None:
    """A listener on 127.0.0.2:P makes P unusable for a server on all addresses (TCPStore), so
    a port for 127.0.0.1 must be free on every address, not on 127.0.0.1 alone."""
    held_port, spare = ports.free_ports(["127.0.0.1"] * 2)
    with socket.socket() as held:
        held.bind(("127.0.0.2", held_port))
        held.listen()
        draws = iter([held_port, spare])
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(draws))
        assert ports.free_ports(["127.0.0.1"]) == [spare]
