"""The NCCL backend's CPU-side logic, on a machine without a GPU (and without cupy):
unique-id bootstrap between real processes over real sockets, probe reasons, the dtype and
op plans, device choice, split plans, GPU array detection and the pinned pool's bookkeeping.
The device path itself is tested by tests/gpu (scripts/gpu_check.sh)."""
from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from ranks import ROOT, collect, free_ports

from adapter import gpu
from adapter.backends.base import ReduceOp
from adapter.backends.elements import BFLOAT16, DTYPE_CODES, reduce_into
from adapter.backends.nccl import backend as nccl
from adapter.backends.nccl import bootstrap as nccl_bootstrap
from adapter.backends.nccl import device as nccl_device
from adapter.backends.nccl.types import (
    BOOL_OPS,
    NCCL_BFLOAT16,
    NCCL_FLOAT32,
    NCCL_FLOAT64,
    NCCL_INT32,
    NCCL_MAX,
    NCCL_MIN,
    NCCL_SUM,
    NCCL_UINT8,
    NCCL_UINT32,
    reduce_plan,
)
from adapter.backends.transport import tcp
from adapter.errors import BackendUnavailable, ConfigError, PeerError

# One rank of the bootstrap: rank 0 serves random bytes, the others fetch; all print the hex.
RANK_CODE = """
import os, sys
from adapter.backends.nccl import bootstrap as nccl_bootstrap
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
uid = nccl_bootstrap.exchange_id(rank, world, "127.0.0.1", port, lambda: os.urandom(128), float(sys.argv[4]))
print(uid.hex())
"""


def spawn_rank(rank: int, world: int, port: int, limit: float = 20.0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-c", RANK_CODE, str(rank), str(world), str(port), str(limit)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- bootstrap ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_rank0_serves_an_opaque_id_to_three_ranks():
    port = free_ports(1)[0]
    # Start the fetching ranks first: they must retry until rank 0 listens.
    procs = [spawn_rank(r, 4, port) for r in (3, 1, 2)]
    time.sleep(0.3)
    procs.append(spawn_rank(0, 4, port))
    results = collect(procs, timeout=45)
    for r in results:
        assert r.returncode == 0, r.stderr
    ids = {r.stdout.strip() for r in results}
    assert len(ids) == 1 and len(ids.pop()) == 256


@pytest.mark.timeout(30)
def test_missing_rank0_times_out_naming_the_address():
    port = free_ports(1)[0]
    started = time.monotonic()
    with pytest.raises(PeerError) as info:
        nccl_bootstrap.exchange_id(2, 4, "127.0.0.1", port, os.urandom, connect_timeout=1.0)
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert f"NCCL_HOST_IP:NCCL_PORT = 127.0.0.1:{port}" in message
    assert message.startswith("rank 2:")


@pytest.mark.timeout(30)
def test_rank0_names_the_ranks_that_never_came():
    port = free_ports(1)[0]
    fetcher = spawn_rank(1, 3, port)
    try:
        with pytest.raises(PeerError) as info:
            nccl_bootstrap.exchange_id(0, 3, "127.0.0.1", port, lambda: b"x" * 128, connect_timeout=3.0)
    finally:
        out, err = fetcher.communicate(timeout=20)
    assert fetcher.returncode == 0, err  # rank 1 got the id before rank 0 gave up on rank 2
    assert out.strip() == (b"x" * 128).hex()
    message = str(info.value)
    assert "rank(s) 2 of 3" in message and f"127.0.0.1:{port}" in message


def _serve_in_thread(port: int, world: int, uid: bytes, limit: float):
    listener = tcp.listen("127.0.0.1", port)
    outcome: dict = {}

    def run():
        try:
            nccl_bootstrap.serve_id(listener, world, uid, time.monotonic() + limit)
            outcome["ok"] = True
        except Exception as exc:  # reported by the test
            outcome["error"] = exc
        finally:
            listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.timeout(30)
def test_garbage_connection_is_rejected_and_rank0_keeps_serving():
    port = free_ports(1)[0]
    uid = os.urandom(128)
    thread, outcome = _serve_in_thread(port, 2, uid, 15)
    stray = socket.create_connection(("127.0.0.1", port), timeout=5)
    stray.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 16)
    stray.settimeout(5)
    try:
        assert stray.recv(64) == b""  # closed without being handed the id
    except ConnectionResetError:
        pass  # closed with our bytes unread: a reset, equally a refusal
    stray.close()
    assert nccl_bootstrap.fetch_id("127.0.0.1", port, 1, 2, time.monotonic() + 10) == uid
    thread.join(10)
    assert outcome == {"ok": True}


@pytest.mark.timeout(30)
def test_world_size_mismatch_and_duplicate_rank_are_named():
    port = free_ports(1)[0]
    uid = os.urandom(128)
    thread, outcome = _serve_in_thread(port, 3, uid, 15)
    with pytest.raises(ConfigError, match=r"rank 1 says MLX_WORLD_SIZE=2 but rank 0 has MLX_WORLD_SIZE=3"):
        nccl_bootstrap.fetch_id("127.0.0.1", port, 1, 2, time.monotonic() + 10)
    with pytest.raises(ConfigError, match=r"rank 5 is out of range for MLX_WORLD_SIZE=3"):
        nccl_bootstrap.fetch_id("127.0.0.1", port, 5, 3, time.monotonic() + 10)
    assert nccl_bootstrap.fetch_id("127.0.0.1", port, 1, 3, time.monotonic() + 10) == uid
    with pytest.raises(ConfigError, match=r"two processes have MLX_RANK=1"):
        nccl_bootstrap.fetch_id("127.0.0.1", port, 1, 3, time.monotonic() + 10)
    assert nccl_bootstrap.fetch_id("127.0.0.1", port, 2, 3, time.monotonic() + 10) == uid
    thread.join(10)
    assert outcome == {"ok": True}


@pytest.mark.timeout(30)
def test_another_service_on_the_port_is_reported():
    listener = tcp.listen("127.0.0.1", 0)
    port = listener.getsockname()[1]

    def impostor():
        sock, _ = listener.accept()
        sock.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        time.sleep(0.5)
        sock.close()

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(PeerError, match="not a jacklring rank"):
        nccl_bootstrap.fetch_id("127.0.0.1", port, 1, 2, time.monotonic() + 5)
    listener.close()


@pytest.mark.timeout(30)
def test_world_of_one_needs_no_listener():
    assert nccl_bootstrap.exchange_id(0, 1, "127.0.0.1", 1, lambda: b"solo", 1.0) == b"solo"


@pytest.mark.timeout(30)
def test_id_exchange_through_a_torch_store():
    torch_distributed = pytest.importorskip("torch.distributed")
    from adapter.backends.transport import auth
    from adapter.rendezvous.nccl_id import exchange_id_via_store
    store = torch_distributed.HashStore()
    job = auth.auth_from_secret(b"s" * 32)
    got = {}

    def rank(r):
        got[r] = exchange_id_via_store(store, "g0/nccl_id", r, 3, lambda: bytes(range(128)), job, 10)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {r: bytes(range(128)) for r in range(3)}


def test_unique_id_forms_round_trip():
    raw = bytes(range(256))[::2]
    old_style = nccl_bootstrap.id_as_tuple(raw)
    assert all(-128 <= c <= 127 for c in old_style)
    assert nccl_bootstrap.id_to_bytes(old_style) == raw
    assert nccl_bootstrap.id_to_bytes(raw) == raw


# ---- probe and create ---------------------------------------------------------------------------

NCCL_ENV = {"MLX_RANK": "0", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": "29555"}


@pytest.mark.parametrize("missing", sorted(NCCL_ENV))
def test_probe_names_each_missing_variable(monkeypatch, missing):
    for name, value in NCCL_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(missing)
    assert nccl.probe() == f"{missing} not set"


def test_probe_names_all_missing_variables(monkeypatch):
    for name in NCCL_ENV:
        monkeypatch.delenv(name, raising=False)
    assert nccl.probe() == "MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP and NCCL_PORT not set"


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_probe_reports_hidden_devices(monkeypatch, hidden):
    for name, value in NCCL_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert nccl.probe() == f"no CUDA device visible (CUDA_VISIBLE_DEVICES={hidden!r})"


@pytest.mark.skipif(nccl_device.cuda_visible_reason() is None, reason="this machine has a CUDA device")
def test_without_a_gpu_nccl_never_starts(monkeypatch):
    from adapter import group

    for name, value in NCCL_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    monkeypatch.delenv("MLX_JACCL_COORDINATOR", raising=False)
    assert nccl.probe().startswith("no CUDA device visible")
    assert not group.is_available("nccl")
    group._reset_for_tests()
    try:
        with pytest.raises(BackendUnavailable, match=r"nccl: no CUDA device visible"):
            group.init(strict=True, backend="nccl")
        assert group.init(backend="any").backend_name != "nccl"
    finally:
        group._reset_for_tests()
    with pytest.raises(ConfigError, match=r"rank 0: no CUDA device visible"):
        nccl.create()


def test_environment_errors_name_the_variable(monkeypatch):
    for name, value in NCCL_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLX_WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="MLX_WORLD_SIZE='two'"):
        nccl.world_from_env()
    monkeypatch.setenv("MLX_WORLD_SIZE", "2")
    monkeypatch.setenv("MLX_RANK", "2")
    with pytest.raises(ConfigError, match=r"MLX_RANK=2 is out of range \(world size 2\)"):
        nccl.world_from_env()
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setenv("NCCL_PORT", "http")
    with pytest.raises(ConfigError, match="NCCL_HOST_IP:NCCL_PORT '127.0.0.1:http'"):
        nccl.world_from_env()
    monkeypatch.setenv("NCCL_PORT", "29555")
    assert nccl.world_from_env() == (1, 2, "127.0.0.1", 29555)


# ---- dtype and op plans -------------------------------------------------------------------------

def test_native_dtypes_go_straight_to_nccl():
    assert reduce_plan(np.float32, ReduceOp.SUM).nccl_dtype == NCCL_FLOAT32
    assert reduce_plan(BFLOAT16, ReduceOp.MAX).nccl_dtype == NCCL_BFLOAT16
    plan = reduce_plan(np.float64, ReduceOp.MIN)
    assert (plan.nccl_dtype, plan.nccl_op, plan.per_element, plan.widen_to) == (NCCL_FLOAT64, NCCL_MIN, 1, None)


@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float32, BFLOAT16])
def test_bitwise_ops_raise_type_error_naming_the_op(op, dtype):
    with pytest.raises(TypeError, match=f"NCCL has no {op.name} reduction"):
        reduce_plan(dtype, op)


def test_complex_is_summed_as_pairs_of_reals_only():
    plan = reduce_plan(np.complex64, ReduceOp.SUM)
    assert (plan.nccl_dtype, plan.per_element) == (NCCL_FLOAT32, 2)
    assert reduce_plan(np.complex128, ReduceOp.SUM).nccl_dtype == NCCL_FLOAT64
    with pytest.raises(TypeError, match="complex dtype complex64 with SUM only, not PROD"):
        reduce_plan(np.complex64, ReduceOp.PROD)
    # The premise: a sum of complex arrays is the sum of their (real, imag) float pairs.
    a, b = np.array([1 + 2j, -3.5 + 0.25j], np.complex64), np.array([0.5 - 1j, 2 + 2j], np.complex64)
    assert np.array_equal((a.view(np.float32) + b.view(np.float32)).view(np.complex64), a + b)


@pytest.mark.parametrize("narrow,wide,code", [(np.int16, np.int32, NCCL_INT32), (np.uint16, np.uint32, NCCL_UINT32)])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN])
def test_16_bit_integers_widen_with_the_same_bits(narrow, wide, code, op):
    plan = reduce_plan(narrow, op)
    assert plan.widen_to == np.dtype(wide) and plan.nccl_dtype == code
    rng = np.random.default_rng(0)
    info = np.iinfo(narrow)
    parts = [rng.integers(info.min, info.max, 64, endpoint=True).astype(narrow) for _ in range(4)]
    expected = parts[0].copy()
    wide_acc = parts[0].astype(wide)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}[op]
    for p in parts[1:]:
        reduce_into(expected, expected, p, op)
        wide_acc = ufunc(wide_acc, p.astype(wide))
    assert np.array_equal(wide_acc.astype(narrow), expected)


@pytest.mark.parametrize("op", sorted(BOOL_OPS, key=lambda o: o.value))
def test_bool_ops_match_the_cpu_backends(op):
    plan = reduce_plan(np.bool_, op)
    assert plan.nccl_dtype == NCCL_UINT8
    a = np.array([False, False, True, True])
    b = np.array([False, True, False, True])
    expected = np.empty(4, np.bool_)
    reduce_into(expected, a, b, op)
    as_bytes = {NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}[plan.nccl_op](a.view(np.uint8), b.view(np.uint8))
    assert np.array_equal(as_bytes.view(np.bool_), expected)


def test_bool_xor_is_refused():
    with pytest.raises(TypeError, match="NCCL has no BXOR reduction for bool"):
        reduce_plan(np.bool_, ReduceOp.BXOR)


def test_every_jacklring_dtype_has_a_plan_or_a_clear_refusal():
    for dtype in DTYPE_CODES:
        for op in ReduceOp:
            try:
                plan = reduce_plan(dtype, op)
            except TypeError as exc:
                assert op.name in str(exc), (dtype, op, exc)
                continue
            assert plan.nccl_op in (NCCL_SUM, 1, NCCL_MAX, NCCL_MIN)
    for dtype in DTYPE_CODES:  # the four NCCL ops cover every real dtype
        if np.dtype(dtype).kind != "c":
            for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN):
                reduce_plan(dtype, op)


# ---- devices and split --------------------------------------------------------------------------

def test_device_choice():
    assert nccl_device.choose_device(5, 4, {}) == 1
    assert nccl_device.choose_device(5, 4, {"LOCAL_RANK": "2"}) == 2
    assert nccl_device.choose_device(5, 1, {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}) == 0
    assert nccl_device.choose_device(0, 8, {"OMPI_COMM_WORLD_LOCAL_RANK": "9"}) == 1
    assert nccl_device.choose_device(0, 8, {"LOCAL_RANK": "1", "JACKLRING_CUDA_DEVICE": "6"}) == 6
    with pytest.raises(ConfigError, match="JACKLRING_CUDA_DEVICE=8 but only 8 device"):
        nccl_device.choose_device(0, 8, {"JACKLRING_CUDA_DEVICE": "8"})
    with pytest.raises(ConfigError, match="rank 3: no CUDA device visible"):
        nccl_device.choose_device(3, 0, {})
    with pytest.raises(ConfigError, match="LOCAL_RANK='x'"):
        nccl_device.choose_device(0, 2, {"LOCAL_RANK": "x"})





def test_split_plan_orders_by_key_then_rank():
    records = [(0, 5), (1, 0), (0, 1), (1, 0), (0, 1)]
    assert nccl_bootstrap.plan_split(records, 0) == ([2, 4, 0], 2)
    assert nccl_bootstrap.plan_split(records, 4) == ([2, 4, 0], 1)
    assert nccl_bootstrap.plan_split(records, 3) == ([1, 3], 1)


# ---- adapter.gpu without a GPU ------------------------------------------------------------------

def test_host_arrays_are_not_cuda_arrays():
    torch = pytest.importorskip("torch")
    for x in (np.ones(3), torch.ones(3), [1.0], 3.0, None, torch.ones(2, dtype=torch.bfloat16)):
        assert not gpu.is_cuda_array(x)
        assert gpu.array_kind(x) == "host"
    with pytest.raises(TypeError, match="not a cupy array or CUDA tensor"):
        gpu.device_buffer(np.ones(3))


@pytest.mark.skipif(nccl_device.cuda_visible_reason() is None, reason="this machine has a CUDA device")
def test_device_count_is_zero_without_a_gpu_and_never_raises(monkeypatch):
    assert gpu.device_count() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpu.device_count() == 0


def test_torch_dtypes_map_to_numpy():
    torch = pytest.importorskip("torch")
    assert gpu.numpy_dtype_of(torch.ones(1, dtype=torch.bfloat16)) == BFLOAT16
    assert gpu.numpy_dtype_of(torch.ones(1, dtype=torch.uint16)) == np.uint16
    assert gpu.numpy_dtype_of(torch.ones(1, dtype=torch.complex64)) == np.complex64
    with pytest.raises(TypeError, match="float8"):
        gpu.numpy_dtype_of(torch.ones(1).to(torch.float8_e4m3fn))


def test_pinned_pool_reuses_blocks_once_every_view_is_gone():
    # Ordinary host memory stands in for page-locked memory (which needs a CUDA driver); what
    # is tested is the pool's bookkeeping: size classes, reuse, and no reuse while a view lives.
    owners = []

    def allocate(nbytes, library):
        block = np.zeros(nbytes, np.uint8)
        owners.append(library)
        return block.ctypes.data, block

    pool = gpu.PinnedPool(max_cached_bytes=1 << 20, allocate=allocate)
    a = pool.take(3000, "torch")
    assert a.size == 3000 and pool.allocations == 1
    view = a.view(np.float32).reshape(25, 30)
    del a
    gc.collect()
    b = pool.take(4096, "torch")  # same size class, but `view` still holds the first block
    assert pool.allocations == 2
    view[...] = 1.0
    assert not b.any()
    del view
    gc.collect()
    c = pool.take(100, "cupy")
    assert pool.allocations == 2  # the first block came back
    assert pool.take(0, "cupy").size == 0
    big = pool.take(3 << 20, "torch")  # larger than the cache: dropped when collected
    del big, b, c
    gc.collect()
    pool.take(3 << 20, "torch")
    assert pool.allocations == 4
    assert owners == ["torch", "torch", "torch", "torch"]
    assert gpu.PinnedPool.size_class(1) == 4096 and gpu.PinnedPool.size_class(4097) == 8192
