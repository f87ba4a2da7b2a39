"""A connection flood at a running job's port (issue #44 item 5). One process churning
connections as fast as it can at rank 0's listener cost the acceptor thread the GIL on every
connection, which slowed the job's collectives 3-9x. Now a listener whose connections come
faster than their sources' budget is left in the kernel's backlog for a while
(acceptor.FLOOD_PAUSE_S), so the flood costs the job little GIL. Measured in interleaved rounds
of one run: a loop of small all_sums on 2 ranks while the outsider (uid 65534) churns at rank
0's TCP port, against the same churn at another listener (a control that costs the machine the
flooding). The assertion is on rank 0's CPU time per all_sum (time.process_time: every thread
of the process, the acceptor's included), flood / control, medians of the rounds: on the shared
2-core host ops/s moves 2-10x between identical rounds with what else runs (and the control
churn, which completes 10-20x more connections, costs the machine more than the throttled
flood), while CPU per operation stays within about 20%. Skipped unless FLOOD_BENCH=1 (numbers in
docs/security.md): a timing, about 30 s."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import pytest
from faults.cluster import finish_all, reports, start, stop_all
from security_helpers import outsider_fixture, wait_ready  # noqa: F401  (the `outsider` fixture)

BODY = """
import pathlib
x = np.ones(16, np.float32)
all_sum(x)
say("READY")
stop = pathlib.Path(os.environ["FAULT_DIR"]) / "stop"
n, last = 0, time.time()
while not stop.exists():
    for _ in range(32):
        all_sum(x)
    n += 32
    now = time.time()
    if r == 0 and now - last >= 0.05:
        say("TICK", f"{now:.4f}", n, f"{time.process_time():.6f}")  # the process's CPU, every thread's
        last = now
"""
ROUND_S = float(os.environ.get("FLOOD_ROUND_S", "1.5"))
ROUNDS = int(os.environ.get("FLOOD_ROUNDS", "6"))
CHURNERS = int(os.environ.get("FLOOD_CHURNERS", "1"))  # churning processes per round (each blocks on a full backlog)
LIMIT = 1.3


def rate(ticks: list[tuple[float, int, float]], begin: float, end: float) -> tuple[float, float]:
    """(all_sums a second, rank 0's CPU microseconds per all_sum) between begin and end."""
    inside = [tick for tick in ticks if begin <= tick[0] <= end]
    assert len(inside) >= 2, (begin, end, ticks[:3], ticks[-3:])
    (t0, n0, c0), (t1, n1, c1) = inside[0], inside[-1]
    return (n1 - n0) / (t1 - t0), (c1 - c0) / (n1 - n0) * 1e6


@pytest.mark.skipif(not os.environ.get("FLOOD_BENCH"),
                    reason="a timing measurement (about 30 s, interleaved rounds); FLOOD_BENCH=1 runs it")
@pytest.mark.timeout(180)
def test_a_connection_flood_costs_a_running_job_at_most_1_3x_cpu_per_op(tmp_path, outsider):
    procs = start("ring", 2, BODY, tmp_path, env={"FAULT_DIR": str(tmp_path)})
    windows: list[tuple[str, float, float, str]] = []
    try:
        for p in procs:
            p.wait_line("READY", 40)
        rank0 = json.loads((tmp_path / "ring-hosts.json").read_text())[0][0]
        sink = outsider("sink.py")
        sink_line = sink.stdout.readline().split()
        assert sink_line[:1] == ["READY"], sink_line
        control = f"127.0.0.1:{sink_line[1]}"
        time.sleep(0.5)
        for _ in range(ROUNDS):
            for kind, target in (("control", control), ("flood", rank0)):
                churns = [outsider("churn.py", ROUND_S, 1e6, target) for _ in range(CHURNERS)]
                for churn in churns:
                    wait_ready(churn)
                begin = time.time()
                said = " /".join(c.communicate(timeout=ROUND_S + 30)[0].split("DONE")[-1].strip() for c in churns)
                windows.append((kind, begin + 0.3, time.time() - 0.1, said))
        (tmp_path / "stop").touch()
        codes = finish_all(procs, 30)
    finally:
        stop_all(procs)
    assert codes == [0, 0], reports(procs)
    ticks = [(float(f[2]), int(f[3]), float(f[4])) for f in procs[0].tagged("TICK")]  # say(): rank, stamp, ours
    rates: dict[str, list[float]] = {"control": [], "flood": []}
    cpu: dict[str, list[float]] = {"control": [], "flood": []}
    for kind, begin, end, churned in windows:
        ops, us = rate(ticks, begin, end)
        rates[kind].append(ops)
        cpu[kind].append(us)
        print(kind, f"{ops:.0f} ops/s", f"{us:.1f} us CPU/op (rank 0)", "churn (connections, refused):", churned)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    slowdown = statistics.median(rates["control"]) / statistics.median(rates["flood"])
    cpu_ratio = statistics.median(cpu["flood"]) / statistics.median(cpu["control"])
    # Rank 0's CPU per all_sum (every thread of the process: the acceptor's too) moves little with
    # what else runs on the host; ops/s moves with it. Both are medians of interleaved rounds.
    print(f"slowdown under the flood: {slowdown:.2f}x ops/s, {cpu_ratio:.2f}x rank 0's CPU per op ({load})")
    assert cpu_ratio <= LIMIT, (rates, cpu, load)

