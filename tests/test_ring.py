"""The ring backend with real processes on 127.0.0.1."""
import pytest
from ranks import assert_all_ok, ring_hostfile, run


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_op_and_dtype(n):
    assert_all_ok(run(n, "ring_scripts/all_ops.py", timeout=140))


@pytest.mark.timeout(90)
def test_several_connections_per_rank_and_uneven_sizes():
    # 3 connections x 2 directions = 6 channels; sizes not divisible by ranks x channels
    assert_all_ok(run(3, "ring_scripts/all_ops.py", ["1,13,100003,300007"], connections=3, timeout=80))


@pytest.mark.timeout(90)
def test_small_and_large_paths_meet_at_the_threshold():
    # 64 KiB is the default switch between the one-pass and the two-phase algorithm
    assert_all_ok(run(2, "ring_scripts/all_ops.py", ["16383,16384,16385"], timeout=80,
                      env={"JACKLRING_RING_SEGMENT_BYTES": "4096"}))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_any_peer_send_recv_split_and_torch_tensors(n):
    assert_all_ok(run(n, "ring_scripts/misc.py", timeout=80))


@pytest.mark.timeout(120)
def test_a_few_hundred_megabytes():
    code = ("import numpy as np, adapter\n"
            "g = adapter.init(strict=True)\n"
            "x = np.full(64 * 1024 * 1024, g.rank() + 1, np.float32)  # 256 MiB\n"
            "y = adapter.all_sum(x)\n"
            "assert y[0] == 3 and y[-1] == 3 and (y == 3).all()\n"
            "print('ok')\n")
    assert_all_ok(run(2, "ring_scripts/exec.py", [code], timeout=110))


@pytest.mark.timeout(90)
def test_tcp_between_local_ranks_when_unix_sockets_are_turned_off():
    # Ranks on one host talk over Unix sockets by default; TCP must work on its own too.
    assert_all_ok(run(3, "ring_scripts/all_ops.py", ["1,70001"], timeout=80,
                      env={"JACKLRING_LOCAL_TRANSPORT": "tcp"}))


@pytest.mark.timeout(90)
def test_ranks_disagreeing_on_the_local_transport_still_connect():
    from ranks import collect, spawn
    hostfile = ring_hostfile(2)
    procs = spawn(2, "ring_scripts/misc.py", hostfile=hostfile, ranks=[0], env={"JACKLRING_LOCAL_TRANSPORT": "tcp"})
    procs += spawn(2, "ring_scripts/misc.py", hostfile=hostfile, ranks=[1])
    assert_all_ok(collect(procs, timeout=80))
