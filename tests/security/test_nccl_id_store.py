"""NCCL's unique id through torch's TCPStore (adapter.rendezvous.nccl_id): a MACed record, so
an id an outsider wrote is refused, never handed to NCCL (which would then join the ranks to
the outsider's clique). No GPU or NCCL needed: the exchange is the store's. Real processes: a
TCPStore served by the test, three rank processes, an outsider of uid 65534 speaking the
store's protocol with the standard library. Before, exchange_id_via_store (in
backends/nccl/bootstrap.py) returned whatever bytes were at the key."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zygote

dist = pytest.importorskip("torch.distributed")

from security_helpers import outsider_fixture, wait_ready  # noqa: E402,F401

from adapter.bench import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "pg0/nccl_id"
THE_ID = bytes(range(128))
RANK_SCRIPT = Path(__file__).resolve().parent / "scripts" / "nccl_id_rank.py"


def run_ranks(port: int, secrets: list[str]) -> list[dict]:
    return run_exchanges([(port, secrets)])[0]


def run_exchanges(exchanges: list[tuple[int, list[str]]]) -> list[list[dict]]:
    """Three rank processes that run the exchanges in turn (each on its store's port, rank q with
    secrets[q]); for each exchange, every rank's result. One set of processes serves them all:
    each imports torch (seconds of CPU) once."""
    procs = [zygote.popen([sys.executable, str(RANK_SCRIPT), str(q), *(f"{port}:{secrets[q]}" for port, secrets in exchanges)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for q in range(3)]
    per_rank = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60 * len(exchanges))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert len(lines) == len(exchanges), f"exit {p.returncode}\n{out}\n{err}"
        per_rank.append([json.loads(line) for line in lines])
    return [[per_rank[q][i] for q in range(3)] for i in range(len(exchanges))]


def serve():
    port = free_ports(1)[0]
    return dist.TCPStore("127.0.0.1", port, 4, True, wait_for_workers=False, multi_tenant=True), port


@pytest.mark.timeout(120)
def test_every_rank_gets_rank_0s_id_and_a_rank_of_another_key_is_refused():
    server, port = serve()
    server2, port2 = serve()
    results, results2 = run_exchanges([(port, ["11" * 32] * 3),
                                       (port2, ["11" * 32, "11" * 32, "22" * 32])])  # rank 2 holds another job's key
    assert [r.get("id") for r in results] == [THE_ID.hex()] * 3, results
    # Every rank publishes a record (and a seal) now, so the others refuse rank 2's as well
    results = results2
    assert all(r.get("error") == "IntegrityError" for r in results), results
    assert "'pg0/nccl_id/0'" in results[2]["text"] or "'pg0/nccl_id/1'" in results[2]["text"], results
    assert all("'pg0/nccl_id/2'" in r["text"] for r in results[:2]), results


@pytest.mark.timeout(150)
def test_an_outsider_overwriting_the_id_is_refused_naming_the_key(outsider):
    """The outsider (uid 65534) writes a record of its own at the id's key before rank 0 and
    every 20 ms after: ranks 1 and 2 end with rank 0's id (read in a gap) or an IntegrityError
    naming the key, within seconds; never with the outsider's bytes."""
    server, port = serve()
    attacker = outsider("store_tamper.py", port, 100, 0.02, free_ports(1)[0], "overwrite", f"/{KEY}/0")
    wait_ready(attacker)
    results = run_ranks(port, ["33" * 32] * 3)
    assert attacker.poll() is None, attacker.stderr.read()
    # rank 0 hands its id over only once every rank sealed what it read: it ends with its id,
    # or with the tampering a peer found (told through the store, not a 20 s wait for a seal)
    if "id" in results[0]:
        assert results[0]["id"] == THE_ID.hex(), results
    else:
        assert results[0]["error"] == "IntegrityError" and "stopped exchanging the NCCL id" in results[0]["text"], results
        assert "was tampered with" in results[0]["text"], results
    for r in results[1:]:
        if "id" in r:
            assert r["id"] == THE_ID.hex(), results
        else:
            assert r["error"] == "IntegrityError" and "was tampered with" in r["text"], results
            assert f"'{KEY}/0'" in r["text"] and "nccl_id record" in r["text"], results
    print(results)


@pytest.mark.timeout(150)
def test_an_id_replayed_from_an_earlier_run_is_refused_naming_its_key(outsider):
    """Run 1 hands over one id; the outsider (uid 65534) reads its records from the store and
    writes them back every 10 ms while run 2 (same secret, same key names) hands over another.
    Before, the id record carried a nonce but nobody compared it: the replayed record passed its
    MAC and ranks 1 and 2 could take run 1's id (whose root address the outsider may hold). Now
    every rank seals the nonces it read: run 2's ranks end with run 2's id or an IntegrityError
    naming a record's key, never with run 1's id."""
    server, port = serve()
    first, second = os.urandom(128).hex(), os.urandom(128).hex()
    secret = "44" * 32
    results = run_ranks(port, [f"{secret}:{first}"] * 3)
    assert [r.get("id") for r in results] == [first] * 3, results
    attacker = outsider("store_replay.py", port, 40, 0.01, *(f"/{KEY}/{q}" for q in range(3)))
    wait_ready(attacker)  # run 1 left 3 records (1 before the seal: rank 0's alone)
    results = run_ranks(port, [f"{secret}:{second}"] * 3)
    attacker.kill()
    assert not any(r.get("id") == first for r in results), results
    assert results[0].get("id") == second or results[0].get("error") == "IntegrityError", results
    for r in results:
        if "id" in r:
            assert r["id"] == second, results
            continue
        assert r["error"] == "IntegrityError" and f"tampered record at key '{KEY}/" in r["text"], results
        assert "seal/" not in r["text"].split(":")[2], results  # the record is named, not a seal
    print(results)
