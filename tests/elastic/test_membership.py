"""The shrink agreement (elastic/membership.py) among seats in threads of one process, over real
sockets: who is in, quorum, late ranks told they were excluded, and keys no excluded rank has."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from adapter.backends.elastic import membership
from adapter.backends.transport import tcp
from adapter.backends.transport.auth import auth_from_secret
from adapter.errors import DistributedError, ExcludedError, PeerError, QuorumError

AUTH = auth_from_secret(b"s" * 32, b"membership-test")
TOKEN = 0x5EED
PURPOSE = 5


def soon() -> float:
    return time.monotonic() + 5.0


def seats(n: int) -> list[membership.Seat]:
    listeners = [tcp.Listener("127.0.0.1", 0, local=False) for _ in range(n)]
    addresses = [s.where() for s in listeners]
    for rank, listener in enumerate(listeners):
        listener.serve(AUTH, TOKEN, rank, lambda h: None if h.purpose == PURPOSE else "no", f"rank {rank}")
    return [membership.Seat(rank, addresses, listeners[rank], AUTH, TOKEN, PURPOSE) for rank in range(n)]


def run_all(chosen: list[membership.Seat], n: int, **kw) -> dict[int, object]:
    """agree() on each chosen seat in a thread; rank -> Decision or the exception raised."""
    results: dict[int, object] = {}

    def one(seat: membership.Seat) -> None:
        try:
            results[seat.rank] = membership.agree(seat, n, {"addr": f"new-{seat.rank}"}, kw.get("exclude", []),
                                                  kw.get("min_size"), kw.get("window", 2.0), 1)
        except DistributedError as exc:
            results[seat.rank] = exc
    threads = [threading.Thread(target=one, args=(s,)) for s in chosen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


@pytest.mark.timeout(30)
def test_the_survivors_agree_on_one_decision_and_a_closed_member_is_out_at_once():
    all_seats = seats(4)
    all_seats[1].listener.close()  # rank 1 is gone: its address refuses
    results = run_all([s for s in all_seats if s.rank != 1], 4, window=10.0)
    decisions = list(results.values())
    assert all(isinstance(d, membership.Decision) for d in decisions), results
    assert {(d.epoch, tuple(d.members), d.nonce, d.coordinator) for d in decisions} == {
        (1, (0, 2, 3), decisions[0].nonce, 0)}
    assert decisions[0].payloads == {0: {"addr": "new-0"}, 2: {"addr": "new-2"}, 3: {"addr": "new-3"}}
    for s in all_seats:
        s.listener.close()


@pytest.mark.timeout(30)
def test_a_minority_raises_quorum_error_unless_min_size_allows_it():
    all_seats = seats(4)
    for dead in (1, 3):
        all_seats[dead].listener.close()
    alive = [all_seats[0], all_seats[2]]
    results = run_all(alive, 4)
    assert all(isinstance(e, QuorumError) and "needs at least 3" in str(e) for e in results.values()), results
    results = run_all(alive, 4, min_size=2)
    assert all(isinstance(d, membership.Decision) and d.members == [0, 2] for d in results.values()), results
    for s in all_seats:
        s.listener.close()


@pytest.mark.timeout(30)
def test_a_rank_that_comes_late_is_told_it_was_excluded():
    all_seats = seats(3)
    results = run_all(all_seats[:2], 3, window=0.5)  # rank 2 does not answer (it is "stopped")
    decision = results[0]
    assert isinstance(decision, membership.Decision) and decision.members == [0, 1], results
    tombstones = [membership.Tombstone(s, decision) for s in all_seats[:2]]
    late = run_all([all_seats[2]], 3)[2]
    assert isinstance(late, ExcludedError) and isinstance(late, PeerError), late
    assert "rank 2 was excluded from the group by shrink (epoch 1)" in str(late) and "[0, 1]" in str(late)
    for t in tombstones:
        t.close()
    for s in all_seats:
        s.listener.close()


def test_the_new_group_key_is_the_decisions_alone():
    one = membership.Decision(1, [0, 1], {}, b"a" * 16, 0)
    assert len({one.key(AUTH).key, membership.Decision(2, [0, 1], {}, b"a" * 16, 0).key(AUTH).key,
                membership.Decision(1, [0, 1], {}, b"b" * 16, 0).key(AUTH).key, AUTH.key}) == 4


@pytest.mark.timeout(30)
def test_an_excluded_rank_with_the_job_key_cannot_connect_to_the_new_group():
    decision = membership.Decision(1, [0, 1], {}, b"n" * 16, 0)
    listener = tcp.Listener("127.0.0.1", 0, local=False)
    listener.serve(decision.key(AUTH), TOKEN, 0, lambda h: None, "new rank 0")
    addr = tcp.parse_address(listener.where())
    hello = tcp.Hello(1, 1, 0, 0, TOKEN)
    with pytest.raises(PeerError, match="did not prove the job secret"):
        with socket.create_connection(addr) as sock:
            tcp.client_handshake(sock, hello.fresh(), AUTH, listener.where(), "rank 0", 1.0)
    with socket.create_connection(addr) as sock:  # a member, told the decision, gets in
        tcp.client_handshake(sock, hello.fresh(), decision.key(AUTH), listener.where(), "rank 0", 1.0)
    listener.close()


@pytest.mark.timeout(30)
def test_a_tampered_frame_fails_its_mac():
    a, b = socket.socketpair()
    sender = membership.Channel(a, AUTH, b"session", True, "peer")
    receiver = membership.Channel(b, AUTH, b"session", False, "peer")
    sender.send({"kind": "decision", "members": [0, 1]}, soon())
    data = bytearray(b.recv(4096))
    data[10] ^= 1
    c, d = socket.socketpair()
    c.sendall(bytes(data))
    with pytest.raises(PeerError, match="failed its MAC"):
        membership.Channel(d, AUTH, b"session", False, "peer").recv(soon())
    sender.send({"kind": "decision"}, soon())  # the next frame, untampered, still checks in order
    with pytest.raises(PeerError, match="failed its MAC"):
        receiver.recv(soon())  # frame 1 where frame 0 was expected: a replayed or reordered frame
    for s in (a, b, c, d):
        s.close()


@pytest.mark.timeout(30)
def test_a_silent_coordinator_is_passed_over_and_told_it_was_excluded_when_it_wakes():
    """Rank 0 answers handshakes (its acceptor thread runs) but never takes a join: the others
    give up on it, rank 1 coordinates; rank 0, calling shrink() late, coordinates alone, hears
    from nobody, asks the others and learns that it was excluded."""
    all_seats = seats(3)
    results = run_all(all_seats[1:], 3, window=0.4)
    decision = results[1]
    assert isinstance(decision, membership.Decision) and (decision.members, decision.coordinator) == ([1, 2], 1), \
        results
    tombstones = [membership.Tombstone(s, decision) for s in all_seats[1:]]
    late = run_all([all_seats[0]], 3, window=0.4)[0]
    assert isinstance(late, ExcludedError) and "rank 0 was excluded" in str(late) and "[1, 2]" in str(late), late
    for t in tombstones:
        t.close()
    for s in all_seats:
        s.listener.close()
