"""Ranks that disagree on the layout (their hostfiles differ) all get a ConfigError naming both
views, soon, not a PeerError at the connect deadline; a process without the job secret cannot
make a rank fail that way (transport/layout.py)."""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from adapter.bench import free_ports

ROOT = Path(__file__).resolve().parents[2]
CONNECT_S = 30
PROGRAM = textwrap.dedent("""
    import sys, time, numpy as np, adapter
    t = time.monotonic()
    try:
        g = adapter.init(backend="ring", strict=True)
        x = np.asarray(adapter.all_sum(np.ones(4, np.float32)))
        print("OK", g.rank(), g.size(), float(x[0]), flush=True)
    except adapter.DistributedError as exc:
        print("ERROR", type(exc).__name__, getattr(exc, "culprit", None), round(time.monotonic() - t, 2), exc,
              flush=True)
        sys.exit(3)
""")


def env(rank: int, hostfile: Path, secret: str | None, connect_s: int = CONNECT_S, **extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("JACKLRING_", "MLX_", "OMPI_", "PMI")) and k not in ("RANK", "WORLD_SIZE")}
    clean.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile),
                 JACKLRING_CONNECT_TIMEOUT=str(connect_s), JACKLRING_TIMEOUT=str(connect_s))
    if secret is not None:
        clean["JACKLRING_SECRET"] = secret
    clean.update(extra)
    return clean


def start(rank: int, hostfile: Path, secret: str | None, connect_s: int = CONNECT_S, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROGRAM], env=env(rank, hostfile, secret, connect_s, **extra),
                            cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    until = time.monotonic() + timeout
    out = []
    for proc in procs:
        try:
            o, e = proc.communicate(timeout=max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            o, e = proc.communicate()
        out.append((proc.returncode, o, e))
    return out


def error_line(result: tuple[int, str, str]) -> list[str]:
    code, out, err = result
    line = next((line for line in out.splitlines() if line.startswith("ERROR")), None)
    assert code == 3 and line is not None, result
    return line.split(" ", 4)  # ERROR, kind, culprit, elapsed, text


def hostfile(path: Path, addresses: list[str]) -> Path:
    path.write_text(json.dumps([[a] for a in addresses]))
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", [0.0, 0.5])
def test_ranks_that_disagree_on_the_world_size_all_get_a_config_error(tmp_path, late):
    """Ranks 0, 1 and 3 read a hostfile of 4 ranks, rank 2 one of 3 (the same first three):
    every rank raises ConfigError naming both views within seconds of a 30 s deadline, also
    rank 3 started `late` seconds after the others (the ranks that found the mismatch stay 2 s
    to tell it)."""
    addresses = [f"127.0.0.1:{p}" for p in free_ports(4)]
    four = hostfile(tmp_path / "four.json", addresses)
    three = hostfile(tmp_path / "three.json", addresses[:3])
    secret = "drawn256:" + secrets.token_hex(32)
    procs = [start(r, three if r == 2 else four, secret) for r in range(3)]
    time.sleep(late)
    procs.append(start(3, four, secret))
    results = finish(procs, CONNECT_S + 40)
    for rank, result in enumerate(results):
        _, kind, _, elapsed, text = error_line(result)
        assert kind == "ConfigError", (rank, result)
        # Who met rank 2's view first varies (a 4-rank view connecting to it, or probing it as
        # its left neighbour); the others were told by that rank, and say so.
        assert re.search(r"rank 2 believes the world has 3 ranks, rank [013] believes 4|"
                         r"rank [013] believes the world has 4 ranks, rank 2 believes 3", text), (rank, text)
        assert text.startswith(f"rank {rank}: "), (rank, text)
        assert float(elapsed) < 10.0, (rank, text)
    assert "reported by" not in error_line(results[2])[4]  # rank 2 compared itself


@pytest.mark.timeout(120)
def test_a_rank_whose_hostfile_contradicts_world_size_tells_the_others(tmp_path):
    """RANK and WORLD_SIZE=4 as a launcher sets them; rank 2's hostfile lists 3 ranks. Rank 2
    raises at once that its hostfile contradicts WORLD_SIZE, but first answers layout checks
    where its hostfile puts it for 2 s: the others raise the layout's ConfigError, not a
    PeerError at the deadline."""
    addresses = [f"127.0.0.1:{p}" for p in free_ports(4)]
    four = hostfile(tmp_path / "four.json", addresses)
    three = hostfile(tmp_path / "three.json", addresses[:3])
    secret = "drawn256:" + secrets.token_hex(32)
    procs = [start(r, three if r == 2 else four, secret, RANK=str(r), WORLD_SIZE="4") for r in range(4)]
    results = finish(procs, CONNECT_S + 40)
    _, kind, _, _, text = error_line(results[2])
    assert kind == "ConfigError" and "rank 2: the launcher started 4 ranks (WORLD_SIZE=4) but MLX_HOSTFILE" in text, \
        results[2]
    for rank in (0, 1, 3):
        _, kind, _, elapsed, text = error_line(results[rank])
        assert kind == "ConfigError" and "rank 2 believes the world has 3 ranks" in text, (rank, text)
        assert float(elapsed) < 10.0, (rank, text)


@pytest.mark.timeout(120)
def test_ranks_whose_hostfiles_list_other_addresses_get_a_config_error(tmp_path):
    """The same world size, another address for rank 1 in rank 0's hostfile: rank 1 reaches
    rank 0, which answers as another job; both compare layouts and raise."""
    a0, a1, stale = (f"127.0.0.1:{p}" for p in free_ports(3))
    secret = "drawn256:" + secrets.token_hex(32)
    procs = [start(0, hostfile(tmp_path / "zero.json", [a0, stale]), secret),
             start(1, hostfile(tmp_path / "one.json", [a0, a1]), secret)]
    results = finish(procs, CONNECT_S + 40)
    for rank, result in enumerate(results):
        _, kind, culprit, elapsed, text = error_line(result)
        assert kind == "ConfigError" and culprit == str(1 - rank), (rank, result)
        assert f"hostfile lists other addresses than rank {rank}'s (both list 2 ranks)" in text, (rank, text)
        assert float(elapsed) < 10.0, (rank, text)


@pytest.mark.timeout(120)
def test_without_a_job_secret_no_layout_is_compared(tmp_path):
    """No secret, no key to compare layouts under: the ranks fail the old way, a PeerError at
    the (short) connect deadline, never the layout's ConfigError."""
    a0, a1, stale = (f"127.0.0.1:{p}" for p in free_ports(3))
    procs = [start(0, hostfile(tmp_path / "zero.json", [a0, stale]), None, connect_s=3),
             start(1, hostfile(tmp_path / "one.json", [a0, a1]), None, connect_s=3)]
    for rank, result in enumerate(finish(procs, 60)):
        _, kind, _, elapsed, text = error_line(result)
        assert kind == "PeerError" and "layout" not in text, (rank, result)
        assert float(elapsed) >= 2.9, (rank, text)


OUTSIDER = textwrap.dedent("""
    import sys, time
    from adapter.backends.transport import auth, layout, tcp
    address, seconds, secret = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    # A stranger's layout claim: 7 ranks, under a secret of its own (or none it could prove).
    check = layout.Check(layout.View(1, 7, bytes(32)), auth.Secret(bytes.fromhex(secret), True))
    until = time.monotonic() + seconds
    asked = answered = 0
    while time.monotonic() < until:
        asked += 1
        if tcp.ask_layout(check, address, 0, time.monotonic() + 0.5) is not None:
            answered += 1
        time.sleep(0.05)
    print("OUTSIDER", asked, answered, flush=True)
""")


@pytest.mark.timeout(120)
def test_an_outsider_claiming_another_world_size_cannot_fail_a_rank(tmp_path):
    """While rank 0 forms (rank 1 starts 2 s late), a process with a wrong secret asks rank 0's
    listener for its layout again and again, claiming a world of 7: it is refused (never
    answered), and the ranks form and sum as usual."""
    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    path = hostfile(tmp_path / "hosts.json", addresses)
    secret = "drawn256:" + secrets.token_hex(32)
    rank0 = start(0, path, secret)
    time.sleep(0.5)
    outsider = subprocess.Popen([sys.executable, "-c", OUTSIDER, addresses[0], "3", secrets.token_hex(32)],
                                env=env(0, path, None), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    time.sleep(2.0)
    rank1 = start(1, path, secret)
    (c0, o0, e0), (c1, o1, e1), (cx, ox, ex) = finish([rank0, rank1, outsider], CONNECT_S + 40)
    assert c0 == 0 and "OK 0 2 2.0" in o0, (o0, e0)
    assert c1 == 0 and "OK 1 2 2.0" in o1, (o1, e1)
    assert cx == 0, (ox, ex)
    _, asked, answered = ox.split()
    assert int(asked) >= 5 and answered == "0", ox
