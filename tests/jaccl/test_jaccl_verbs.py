"""The verbs transport's device-free layer (work-request ids, posted-work table, completion-status
errors, GID choice, buffer pool, device probing), plus device tests that skip without RDMA."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from adapter.backends.transport import verbs
from adapter.backends.transport.slots import RECV, SEND, BufferPool
from adapter.errors import BackendUnavailable, PeerError

REPO = Path(__file__).resolve().parents[2]

try:
    from pyverbs import enums as ibv
    from pyverbs.cq import WC
except ImportError:  # pyverbs is the optional "rdma" extra
    ibv = WC = None

RETRY_EXC_ERR = ibv.IBV_WC_RETRY_EXC_ERR if ibv else 12


def work_completion(wr_id: int, status: int = 0, byte_len: int = 0):
    """A real pyverbs WC when pyverbs is installed, else the same fields in a namespace."""
    if WC is not None:
        return WC(wr_id=wr_id, status=status, opcode=0, byte_len=byte_len)
    return types.SimpleNamespace(wr_id=wr_id, status=status, vendor_err=0, byte_len=byte_len)


def test_work_request_ids_round_trip():
    for kind, peer, slot in [(SEND, 0, 0), (RECV, 7, 1), (SEND, 65535, 255)]:
        assert verbs.decode_wr_id(verbs.encode_wr_id(kind, peer, slot)) == (kind, peer, slot)
    ids = {verbs.encode_wr_id(k, p, s) for k in (SEND, RECV) for p in range(4) for s in range(3)}
    assert len(ids) == 24
    with pytest.raises(ValueError):
        verbs.encode_wr_id(SEND, 1 << 16, 0)
    with pytest.raises(ValueError):
        verbs.encode_wr_id(9, 0, 0)


def test_pending_work_rejects_reuse_of_a_busy_slot_and_unknown_completions():
    pending = verbs.PendingWork(rank=2)
    wr = pending.post(SEND, 1, 0)
    pending.post(RECV, 1, 0)   # a receive slot is a different buffer
    with pytest.raises(RuntimeError, match="slot 0 to rank 1 is already posted"):
        pending.post(SEND, 1, 0)
    assert "send slot 0 with rank 1" in pending.describe()
    assert pending.complete(wr) == (SEND, 1, 0)
    pending.post(SEND, 1, 0)   # free again after its completion
    with pytest.raises(PeerError, match="never posted"):
        pending.complete(verbs.encode_wr_id(SEND, 3, 1))
    assert len(pending) == 2


def test_successful_completion_reports_bytes():
    pending = verbs.PendingWork(rank=0)
    wr = pending.post(RECV, 3, 1)
    c = verbs.check_completion(work_completion(wr, 0, 4096), pending, rank=0)
    assert (c.kind, c.peer, c.slot, c.nbytes) == (RECV, 3, 1, 4096)


def test_failed_completion_raises_naming_peer_and_status():
    pending = verbs.PendingWork(rank=0)
    wr = pending.post(SEND, 2, 0)
    with pytest.raises(PeerError) as info:
        verbs.check_completion(work_completion(wr, RETRY_EXC_ERR), pending, rank=0)
    message = str(info.value)
    assert "rank 0" in message and "send with rank 2" in message and f"ibv status {RETRY_EXC_ERR}" in message
    if ibv is not None:
        assert "retry exceeded error" in message
    assert len(pending) == 0  # the failed request is not left behind as posted


def test_status_text_uses_the_verbs_names():
    if ibv is None:
        assert verbs.status_text(5) == "status 5"
    else:
        assert verbs.status_text(ibv.IBV_WC_WR_FLUSH_ERR) == "WR flush error"
        assert verbs.status_text(ibv.IBV_WC_LOC_LEN_ERR) == "local length error"


def test_gid_choice(monkeypatch):
    monkeypatch.delenv("JACKLRING_IBV_GID_INDEX", raising=False)
    link_local = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    mapped = "0000:0000:0000:0000:0000:ffff:c0a8:0102"
    empty_mapped = "0000:0000:0000:0000:0000:ffff:0000:0000"
    assert verbs.choose_gid_index([link_local, None, empty_mapped, mapped]) == 3
    with pytest.raises(BackendUnavailable, match="IPv4-mapped"):
        verbs.choose_gid_index([link_local])
    monkeypatch.setenv("JACKLRING_IBV_GID_INDEX", "1")
    assert verbs.choose_gid_index([link_local]) == 1


def test_buffer_pool_allocates_each_slot_once():
    made = []
    pool = BufferPool(1024, lambda n, key: made.append(key) or bytearray(n))
    first = pool.get(1, SEND, 0)
    for _ in range(5):
        assert pool.get(1, SEND, 0) is first
    pool.get(1, RECV, 0)
    pool.get(2, SEND, 1)
    assert made == [(1, SEND, 0), (1, RECV, 0), (2, SEND, 1)] and pool.allocations == 3
    assert len(first) == 1024


def test_probe_reports_a_missing_device():
    reason = verbs.probe_devices({"rdma_jacklring_does_not_exist"})
    assert reason is not None
    assert "pyverbs" in reason or "no RDMA device" in reason or "rdma_jacklring_does_not_exist" in reason


def _rdma_devices() -> list[str]:
    try:
        from pyverbs.device import get_device_list
        return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in get_device_list()]
    except Exception:
        return []


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _rdma_devices(), reason="no RDMA device (pyverbs get_device_list() finds none)")
def test_rdma_mesh_two_ranks_on_one_device(tmp_path):
    """Two ranks over queue pairs on the first RDMA device (loopback through the NIC)."""
    device = _rdma_devices()[0]
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps([[None, device], [device, None]]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "jaccl_scripts" / "worker.py"), "ops,p2p", str(tmp_path)],
        env=dict(os.environ, MLX_RANK=str(r), MLX_JACCL_COORDINATOR=f"127.0.0.1:{port}",
                 MLX_IBV_DEVICES=str(devices), PYTHONPATH=str(REPO), JACKLRING_JACCL_TRANSPORT="rdma"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        results = [p.communicate(timeout=50) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["transport"] == "rdma" and r["ops"] == "ok" for r in reports)
