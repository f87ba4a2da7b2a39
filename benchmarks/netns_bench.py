"""Multi-host all_sum benchmark on one machine: every rank in its own network namespace behind a
shaped link (benchmarks/netns_links.py), nccl-tests style tables with busbw as a fraction of the
link rate. Needs root (ip netns, tc).

    sudo .venv/bin/python benchmarks/netns_bench.py -n 2 --rate 1gbit
    sudo .venv/bin/python benchmarks/netns_bench.py -n 4 --rate 500mbit --backend ring,jaccl --compare gloo
    sudo .venv/bin/python benchmarks/netns_bench.py -n 4 --ranks-per-host 2 --backend ring,ring-unix
    sudo .venv/bin/python benchmarks/netns_bench.py -n 4 --ranks-per-host 2 --backend jaccl,jaccl-flat
    sudo .venv/bin/python benchmarks/netns_bench.py --cleanup        # leftovers of a killed run

The ranks get the real environment contract, with addresses inside the namespaces only
(SUBNET.1 ... SUBNET.n, or one per namespace of --ranks-per-host ranks): MLX_RANK / MLX_HOSTFILE
for the ring, MLX_JACCL_COORDINATOR and MLX_IBV_DEVICES (devices that do not exist, so JACCL runs over its TCP mesh) for JACCL,
MASTER_ADDR for torch's gloo; ring-1dir is a second ring group whose large reductions go one
way round (JACKLRING_RING_DIRECTIONS=1); jaccl-flat a second JACCL group that never shares memory
(its mesh for every collective, as ring-unix for the ring). Timing, warm-up and the table are adapter.bench's (interleaved
rounds). First a plain TCP ring (benchmarks/tcp_ceiling.py) measures what the links carry.

Open MPI (--compare mpi: its TCP BTL) runs as one mpirun in rank 0's namespace that starts its
daemon in every other namespace through benchmarks/netns_agent.sh as its launch agent (instead of
ssh), each in a UTS namespace of its own, since Open MPI tells nodes apart by host name; then
every library's ranks run under that mpirun, still interleaved. --bind-to none: each namespace
looks like a node of its own, and mpirun would pin every rank to the same first core.

Every exit path removes the namespaces (and with them the veths and qdiscs): finally blocks,
SIGINT/SIGTERM/SIGHUP handlers, and the ranks die with this process (parent-death signal).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import netns_links
from netns_links import Links

from adapter import bench

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OURS = ("ring", "ring-unix", "ring-1dir", "ring-native", "jaccl", "jaccl-flat", "jaccl-native")
OTHERS = ("gloo", "mpi")
BASE_PORT = 20000  # every namespace has its own ports: nothing else listens there


def parse_rate(text: str) -> float:
    """bits/s from 1gbit, 500mbit, 1e9."""
    match = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([kmg]?)(?:bit)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate such as 1gbit or 500mbit")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def on_signal(signum: int, _frame) -> None:
    # Turned into an exception so that the finally blocks remove the namespaces.
    raise SystemExit(128 + signum)


def in_namespace(links: Links) -> Callable[[int], list[str]]:
    """Rank r's command prefix: inside its namespace, killed when this process dies."""
    return lambda r: ["setpriv", "--pdeathsig", "KILL", *links.exec_prefix(r)]


def tcp_ceiling(links: Links, tmp: str, seconds: float) -> list[float]:
    """Bytes/s each rank received over a plain TCP ring."""
    hosts = ",".join(links.address(r) for r in range(links.ranks))
    outs = [os.path.join(tmp, f"tcp{r}.json") for r in range(links.ranks)]
    procs = [subprocess.Popen(in_namespace(links)(r) + [
        sys.executable, str(HERE / "tcp_ceiling.py"), "--rank", str(r), "--hosts", hosts,
        "--port", str(BASE_PORT - 1), "--seconds", str(seconds), "--out", outs[r]]) for r in range(links.ranks)]
    try:
        codes = [p.wait(timeout=seconds + 60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise SystemExit(f"netns_bench: the plain TCP ring failed (exit codes {codes})")
    rates = []
    for path in outs:
        with open(path) as f:
            res = json.load(f)
        rates.append(res["bytes"] / res["seconds"])
    return rates


def mpi_launch(links: Links, tmp: str) -> tuple[list[str], dict[str, str]]:
    """The words that start mpirun in rank 0's namespace with one rank per namespace, and the
    environment its launch agent and the TCP BTL need."""
    hosts = [links.address(r) for r in range(links.ranks)]
    hostfile = os.path.join(tmp, "mpi-hosts")
    with open(hostfile, "w") as f:
        f.writelines(f"{h} slots=1\n" for h in hosts)
    words = in_namespace(links)(0) + [
        "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', links.namespace(0),
        bench.find_mpirun(), "--hostfile", hostfile, "-n", str(links.ranks), "--bind-to", "none",
        "--prtemca", "plm_ssh_agent", str(HERE / "netns_agent.sh"), "--prtemca", "oob_tcp_if_include", "eth0"]
    env = {"NETNS_BENCH_HOSTS": " ".join(f"{h}={links.namespace(r)}" for r, h in enumerate(hosts)),
           "OMPI_MCA_btl_tcp_if_include": "eth0"}
    return words, env


def run(opts: argparse.Namespace) -> int:
    per_host = opts.ranks_per_host
    links = Links(opts.n // per_host, opts.rate, subnet=opts.subnet, queue_bytes=opts.queue)
    tmp = tempfile.mkdtemp(prefix="jacklring-netns-")
    link_rate = opts.rate / 8
    try:
        links.create()
        print(f"# {opts.n} ranks, {per_host} per namespace, in namespaces {links.prefix}-r*, {links.address(0)}.."
              f"{links.address(links.ranks - 1)}, tbf {opts.rate / 1e6:g} Mbit/s each way "
              f"(burst {netns_links.burst_bytes(opts.rate)} B, queue {links.limit()} B)")
        if opts.ceiling_seconds > 0:
            rates = tcp_ceiling(links, tmp, opts.ceiling_seconds)
            print(f"# plain TCP ring, {opts.ceiling_seconds:g} s: received per rank " + ", ".join(
                f"{r / 1e6:.1f} MB/s" for r in rates) + f"; slowest = {min(rates) / link_rate:.3f} of the link")
        compare = ",".join("mpi-tcp" if b == "mpi" else b for b in opts.compare.split(",") if b)
        argv = ["-n", str(opts.n), "--backend", opts.backend, "--compare", compare, "--sizes", opts.sizes,
                "--rounds", str(opts.rounds), "--iters", str(opts.iters), "--budget-bytes", str(opts.budget_bytes),
                "--stat", opts.stat, "--timeout", str(opts.timeout)]
        args = bench.parse_args(argv)
        hosts = [links.address(r // per_host) for r in range(opts.n)]
        env = dict(os.environ, **bench.contract_env(opts.n, hosts, iter(range(BASE_PORT, BASE_PORT + 1000)), tmp, 1,
                                                   args.backends))
        # gloo finds its interface by the host name otherwise, which resolves outside the namespaces.
        env.update(GLOO_SOCKET_IFNAME="eth0", JACKLRING_CONNECT_TIMEOUT="60",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        launch = None
        if "mpi-tcp" in args.backends:
            launch, mpi_env = mpi_launch(links, tmp)
            env.update(mpi_env)
        in_host = in_namespace(links)
        results = bench.measure(args, argv, env, tmp, lambda r: in_host(r // per_host), launch)
        if results is None:
            print("netns_bench: a rank failed (its output is above)", file=sys.stderr)
            return 1
        bench.report(args, results, opts.n, link_rate=link_rate)
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        links.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
        left = links.leftovers()
        if left:
            print(f"netns_bench: could not remove {', '.join(left)}; run with --cleanup", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks per namespace (default 1); a host's ranks share memory, ring-unix is a ring "
                         "group that does not")
    ap.add_argument("--rate", type=parse_rate, default=1e9, help="link rate each way, e.g. 1gbit (default), 500mbit")
    ap.add_argument("--queue", type=bench.parse_size, default=4 << 20,
                    help="tbf queue on each end of each link, bytes (default 4M; at least 10 ms of the rate)")
    ap.add_argument("--backend", default="ring,jaccl",
                    help="ours, comma separated: ring, ring-unix (never shared memory), ring-1dir (large "
                         "reductions one way round), ring-native (the ring's own schedules only), jaccl, "
                         "jaccl-flat (never shared memory), jaccl-native (the mesh's own schedules only)")
    ap.add_argument("--compare", default="", help="others, comma separated: gloo, mpi (Open MPI's TCP BTL)")
    ap.add_argument("--sizes", default="64K,1M,16M,64M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="iterations per round (fewer for big sizes)")
    ap.add_argument("--budget-bytes", type=float, default=64e6, help="cap on bytes per round per backend")
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--ceiling-seconds", type=float, default=3.0, help="plain TCP ring first for this long; 0: skip")
    ap.add_argument("--subnet", default="10.211.0", help="first three octets of the ranks' addresses")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a stuck rank is killed")
    ap.add_argument("--cleanup", action="store_true",
                    help="only remove namespaces left by runs that no longer exist, then exit")
    opts = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("needs root (ip netns, tc)")
    if opts.cleanup:
        gone = netns_links.cleanup_leftovers()
        print(f"removed {len(gone)} namespace(s)" + (": " + ", ".join(gone) if gone else ""))
        return 0
    for option, value, allowed in (("--backend", opts.backend, OURS), ("--compare", opts.compare, OTHERS)):
        unknown = [b for b in value.split(",") if b and b not in allowed]
        if unknown:
            ap.error(f"{option}: {', '.join(unknown)} not offered here; choose from {', '.join(allowed)}")
    if not 2 <= opts.n <= 250:
        ap.error("-n must be between 2 and 250")
    if opts.ranks_per_host < 1 or opts.n % opts.ranks_per_host:
        ap.error(f"--ranks-per-host {opts.ranks_per_host} does not divide -n {opts.n}")
    if opts.ranks_per_host > 1 and "mpi" in opts.compare.split(","):
        ap.error("--compare mpi starts one rank per namespace; leave it out with --ranks-per-host")
    if not re.fullmatch(r"(25[0-5]|2[0-4]\d|1?\d?\d)(\.(25[0-5]|2[0-4]\d|1?\d?\d)){2}", opts.subnet):
        ap.error(f"--subnet {opts.subnet!r}: give the first three octets, e.g. 10.211.0")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
