"""The store ring's rendezvous against an outsider who writes to torch's TCPStore (it has no
authentication: anyone who reaches MASTER_PORT can add and set keys).

The store is served by the test, as torchrun's agent serves it (TORCHELASTIC_USE_AGENT_STORE),
so the outsider can write before the ranks start. The outsider is the test process itself,
a plain TCPStore client: the store's own protocol, nothing a rank could tell apart."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")

import zygote  # noqa: E402
from security_helpers import outsider_fixture, wait_ready  # noqa: E402,F401

from adapter.bench import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = ROOT / "tests" / "engines" / "engine_rank.py"
# adapter.init's keys under the agent's store (engines.STORE_PREFIX through a PrefixStore)
ADAPTER = "jacklring/adapter//jacklring/"
OLD_COUNTER = ADAPTER + "joins"
# The ranks' connect timeout, and the bound that tells an outcome reached by noticing (a record
# checked, a tampered value reported after 5 s) from one reached by waiting out that timeout.
# Elapsed times include the ranks' start-up (15-25 s at a load of 16 on the 2-core machine),
# so the bound sits just under the timeout rather than a few seconds above a quiet start.
CONNECT_S = 60
PROMPT_S = CONNECT_S - 5


def fake_record(rank: int, port: int) -> bytes:
    """What an outsider who knows the format but not the key writes: a plausible record
    pointing at an address of its own."""
    return (b'jr1 ' + b"ab" * 32 + b' {"address":"127.0.0.1:%d","rank":%d,"size":2}' % (port, rank))


def plant(store, rank: int, port: int) -> None:
    """Fake records for rank at the keys of the first formation: the old scheme's generation 0
    (a bare address) and the current tag (a record with a made-up MAC)."""
    store.set(f"{ADAPTER}addr/0/{rank}", f"127.0.0.1:{port}")
    store.set(f"{ADAPTER}addr/f0/{rank}", fake_record(rank, port))


def rank_env(rank: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JACKLRING_", "MLX_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
               JACKLRING_CONNECT_TIMEOUT=str(CONNECT_S), JACKLRING_TIMEOUT=str(CONNECT_S))
    env.update(extra)
    return env


def start(rank: int, port: int) -> subprocess.Popen | zygote.Process:
    return zygote.popen([sys.executable, str(RANK_SCRIPT), "numpy"], env=rank_env(rank, port), cwd=ROOT,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = CONNECT_S + 40) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def serve_store():
    port = free_ports(1)[0]
    server = dist.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False, multi_tenant=True)
    return server, port


@pytest.mark.timeout(180)
def test_a_bumped_counter_and_fake_records_do_not_stop_the_group():
    """Before the ranks start, the outsider adds 1 to the old joins counter and writes fake
    records at every key a rank would publish (the old generation 0 and the new tags). Before,
    the bump alone put the ranks on different generations and each blamed the other after the
    connect timeout; now each rank overwrites its own key and the group forms."""
    server, port = serve_store()
    outsider_port = free_ports(1)[0]
    server.add(OLD_COUNTER, 1)
    for q in range(2):
        plant(server, q, outsider_port)
    begin = time.monotonic()
    procs = [start(q, port) for q in range(2)]
    outcomes = [finish(p) for p in procs]
    elapsed = time.monotonic() - begin
    for code, out, err in outcomes:
        assert code == 0 and '"sum": 1.0' in out, f"exit {code}\n{out}\n{err}"
    assert elapsed < PROMPT_S, elapsed
    # every rank is on this host: the key came from a 0600 file, not through the store
    assert not server.check([f"{ADAPTER}addr/f0/key"])


@pytest.mark.timeout(180)
def test_a_fake_record_of_an_absent_rank_is_reported_as_tampering_naming_the_key():
    """Rank 1 never comes; the outsider wrote a record in its place, pointing at the outsider.
    Rank 0 must say within seconds that the value at that key was tampered with, never connect
    to the outsider (before, it read the address and dialled it)."""
    server, port = serve_store()
    outsider_port = free_ports(1)[0]
    plant(server, 1, outsider_port)
    begin = time.monotonic()
    code, out, err = finish(start(0, port))
    elapsed = time.monotonic() - begin
    assert code != 0 and "RESULT" not in out
    assert "IntegrityError" in err and "was tampered with" in err, err
    assert "'jacklring/addr/f0/1'" in err, err  # names the key (under adapter.init's prefix)
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s"


@pytest.mark.timeout(180)
def test_an_outsider_rewriting_a_record_is_reported_or_outrun_never_blamed_on_a_rank():
    """The outsider keeps rewriting rank 1's record while both ranks form. Rank 1 writes its
    record back; the outcome is either a formed group with the right sum or an IntegrityError
    naming the key, within seconds, and never "ranks [q] did not publish" about a live rank."""
    server, port = serve_store()
    outsider_port = free_ports(1)[0]
    stop = threading.Event()

    def rewrite() -> None:
        client = dist.TCPStore("127.0.0.1", port, 3, False)
        while not stop.is_set():
            plant(client, 1, outsider_port)
            time.sleep(0.02)

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        begin = time.monotonic()
        outcomes = [finish(p) for p in [start(q, port) for q in range(2)]]
        elapsed = time.monotonic() - begin
    finally:
        stop.set()
        writer.join(5)
    for code, out, err in outcomes:
        assert "did not publish" not in err, err
        if code == 0:
            assert '"sum": 1.0' in out, out
    if any(code != 0 for code, _, _ in outcomes):
        assert any("was tampered with" in err and "'jacklring/addr/f0/1'" in err for _, _, err in outcomes), \
            "\n".join(err for _, _, err in outcomes)
    assert elapsed < PROMPT_S, elapsed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["overwrite", "delete", "both"])
def test_an_outsider_of_another_uid_overwriting_and_deleting_records_never_stalls_the_ranks(outsider, mode):
    """A real outsider (uid 65534, the standard library speaking TCPStore's protocol) keeps
    overwriting every rank's record with a fake one and deleting it, every 20 ms, while two
    ranks with a job secret form. Before, a rank whose own record was deleted blocked in the
    store's get() for the store's whole timeout and then blamed the store ("the store closed")
    or its peer ("did not publish"); now it reads without blocking, puts its record back and
    the group forms with the right sum, or a rank reports an IntegrityError naming the key,
    before the connect timeout (a stall lasts that long and then names the wrong cause)."""
    server, port = serve_store()
    keys = [f"/{ADAPTER}addr/f0/{q}" for q in range(2)]
    attacker = outsider("store_tamper.py", port, 3 * CONNECT_S, 0.02, free_ports(1)[0], mode, *keys)
    wait_ready(attacker)
    secret = {"JACKLRING_SECRET": "cd" * 32}
    begin = time.monotonic()
    procs = [zygote.popen([sys.executable, str(RANK_SCRIPT), "numpy"], env=rank_env(q, port, **secret),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for q in range(2)]
    outcomes = [finish(p) for p in procs]
    elapsed = time.monotonic() - begin
    assert attacker.poll() is None, attacker.stderr.read()  # it kept tampering the whole time
    report = "\n".join(f"exit {c}\n{o}\n{e}" for c, o, e in outcomes)
    print(mode, f"{elapsed:.1f} s", attacker.pid, [("formed" if c == 0 else e.strip().splitlines()[-1][:160])
                                                  for c, _, e in outcomes])
    for code, out, err in outcomes:
        assert "did not publish" not in err and "store closed" not in err, report
        if code == 0:
            assert '"sum": 1.0' in out, report
    if any(code != 0 for code, _, _ in outcomes):
        assert any("IntegrityError" in err and "was tampered with" in err and "'jacklring/addr/f0/" in err
                   for _, _, err in outcomes), report
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s\n{report}"


@pytest.mark.timeout(30)
def test_a_deleted_record_is_read_as_missing_and_put_back_without_blocking():
    """get() on a deleted key waits for the store's whole timeout; the records never use it."""
    import datetime

    from adapter.backends.transport import auth
    from adapter.rendezvous import store_records

    server, _ = serve_store()
    server.set_timeout(datetime.timedelta(seconds=20))
    book = store_records.RecordBook(server, "t/", auth.auth_from_secret(b"k" * 32), 0, 2)
    mine = book.publish("127.0.0.1:1")
    server.delete_key("t/0")
    begin = time.monotonic()
    assert store_records.read(server, "t/0") is None
    book.defend(mine)
    assert store_records.read(server, "t/0") == mine and book.tampered == 1
    server.set("t/0", b"forged")
    book.defend(mine)
    assert store_records.read(server, "t/0") == mine and book.tampered == 2
    book.defend(mine)
    assert book.tampered == 2  # intact: nothing counted
    assert time.monotonic() - begin < 2


@pytest.mark.timeout(300)
def test_records_replayed_from_an_earlier_run_are_named_and_never_dialled(outsider):
    """Run 1 forms with a job secret. The outsider (uid 65534) then reads its records from the
    store, listens on the ports they name and writes them back every 10 ms while run 2 forms
    with the same secret and the same key names. Before, a replayed record passed its MAC (it
    binds only the key name): a rank dialled the outsider and handed it a proof, and both ranks
    then reported the other as having died while the group formed. Now every record carries
    its rank's nonce of this run and the ranks compare seals before dialling: run 2 forms, or
    reports a tampered record naming the key (the record's, not the seal that showed it), and no
    proof reaches the outsider."""
    server, port = serve_store()
    secret = {"JACKLRING_SECRET": "cd" * 32}
    def run() -> list[tuple[int, str, str]]:
        procs = [zygote.popen([sys.executable, str(RANK_SCRIPT), "numpy"], env=rank_env(q, port, **secret),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for q in range(2)]
        return [finish(p) for p in procs]

    first = run()
    for code, out, err in first:
        assert code == 0 and '"sum": 1.0' in out, f"run 1: exit {code}\n{out}\n{err}"
    keys = [f"/{ADAPTER}addr/f0/{q}" for q in range(2)]
    attacker = outsider("store_replay.py", port, 2 * CONNECT_S, 0.01, *keys)
    wait_ready(attacker, "READY 2")
    begin = time.monotonic()
    outcomes = run()
    elapsed = time.monotonic() - begin
    attacker.kill()
    said = attacker.communicate()[0]
    report = "\n".join(f"exit {c}\n{o}\n{e}" for c, o, e in outcomes) + f"\noutsider: {said}"
    print(f"{elapsed:.1f} s", [("formed" if c == 0 else e.strip().splitlines()[-1][:200]) for c, _, e in outcomes])
    assert "PROOF" not in said, report  # no rank dialled an address from an earlier run
    for code, out, err in outcomes:
        assert "died while the group formed" not in err, report
        if code == 0:
            assert '"sum": 1.0' in out, report
    if any(code != 0 for code, _, _ in outcomes):
        assert any("IntegrityError" in err and "tampered record at key '" in err for _, _, err in outcomes), report
    for _, _, err in outcomes:
        assert f"tampered record at key '{ADAPTER}addr/f0/seal/" not in err, report  # name the record
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s\n{report}"


def test_a_rank_that_stops_on_tampering_leaves_its_verdict_for_its_peers():
    """A rank that raised on a tampered record writes its words (MACed, with its nonce of this
    run) where a peer looks before it calls that rank dead (store_ring._left): the peer then
    names the tampering. A verdict of another run, or one an outsider forged, says nothing."""
    from adapter.backends.transport import auth
    from adapter.rendezvous import store_records

    server, _ = serve_store()
    key = auth.auth_from_secret(b"k" * 32)
    store_records.tell_tampering(server, "v/", key, 1, 2, "ab" * 16, "tampered record at key 'v/0'")
    assert store_records.told_tampering(server, "v/", key, 0, 2, 1, "ab" * 16) == "tampered record at key 'v/0'"
    assert store_records.told_tampering(server, "v/", key, 0, 2, 1, "cd" * 16) is None  # another run's
    server.set("v/tampered/1", b"jr1 forged {}")
    assert store_records.told_tampering(server, "v/", key, 0, 2, 1, "ab" * 16) is None
    assert store_records.told_tampering(server, "v/", key, 0, 2, 0, "ab" * 16) is None  # nothing there
