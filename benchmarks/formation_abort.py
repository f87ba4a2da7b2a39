"""How long the other ranks take to raise when a rank dies while a ring group forms.

    python benchmarks/formation_abort.py                         # split, 4 and 8 ranks, 5 rounds
    python benchmarks/formation_abort.py --colors parity         # split(rank % 2) instead of split(0)
    python benchmarks/formation_abort.py --case init --ranks 4
    python benchmarks/formation_abort.py --trees old=/tmp/old,new=.   # A/B: two source trees

Each round starts N ring ranks on 127.0.0.1 with a 120 s connect deadline. `split`: after the
parent ring formed, rank 2 kills itself (SIGKILL) as it makes its first sub-ring connection of
split(0) (one sub-group of everyone: every survivor is still forming and learns of the death
through the parent ring, hop by hop; with --colors parity, split(rank % 2), the other
sub-group forms and waits in the closing barrier instead). `init`: rank 2 kills itself right after its first ring connection of init()
and rank 1 holds its own connections back for a second, so it finds rank 2 gone. The time is
from the kill to the last survivor's exception (CLOCK_MONOTONIC is system-wide). With several
trees the rounds alternate between them, so machine noise hits every column alike.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from adapter.bench import free_ports  # noqa: E402

VICTIM = 2

RANK = r"""
import os, signal, sys, time
from adapter.backends.transport import tcp
r = int(os.environ["MLX_RANK"])
real_connect = tcp.connect

def say(*fields):
    print(*fields, f"{time.monotonic():.4f}", flush=True)

def die_after(purpose):
    def connect(addr, hello, *args, **kwargs):
        sock = real_connect(addr, hello, *args, **kwargs)
        if hello.purpose == purpose:
            say("KILLED")
            os.kill(os.getpid(), signal.SIGKILL)
        return sock
    return connect

def slow(addr, hello, *args, **kwargs):
    if hello.purpose == 1:
        time.sleep(1.0)
    return real_connect(addr, hello, *args, **kwargs)

import adapter
CASE = os.environ["BENCH_CASE"]
try:
    if CASE == "init":
        if r == VICTIM:
            tcp.connect = die_after(1)
        elif r == VICTIM - 1:
            tcp.connect = slow
        adapter.init(strict=True, backend="ring")
    else:
        group = adapter.init(strict=True, backend="ring")
        adapter.barrier()
        if r == VICTIM:
            tcp.connect = die_after(1)
        group.split(r % 2 if os.environ["BENCH_COLORS"] == "parity" else 0)
    say("NOERR")
except adapter.DistributedError:
    say("ERR")
""".replace("VICTIM", str(VICTIM))


def one_round(tree: str, n: int, case: str, colors: str) -> float:
    """Seconds from the kill to the last survivor's error (inf if one did not raise in 40 s);
    for init, not counting rank 1, which holds its connections back for a second on purpose."""
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = os.path.join(tmp, "hosts.json")
        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], f)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "JACKLRING_"))}
        env.update(PYTHONPATH=os.path.abspath(tree), MLX_HOSTFILE=hostfile, BENCH_CASE=case, BENCH_COLORS=colors,
                   JACKLRING_CONNECT_TIMEOUT="120", OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, "-c", RANK], env={**env, "MLX_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for r in range(n)]
        try:
            outs = []
            for p in procs:
                try:
                    outs.append(p.communicate(timeout=40)[0])
                except subprocess.TimeoutExpired:
                    p.kill()
                    outs.append(p.communicate()[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
    lines = {r: out.split() for r, out in enumerate(outs)}
    killed = float(lines[VICTIM][1]) if lines[VICTIM][:1] == ["KILLED"] else None
    ends = {r: float(words[1]) for r, words in lines.items() if r != VICTIM and words[:1] == ["ERR"]}
    if killed is None or len(ends) != n - 1:
        return float("inf")
    if case == "init":
        del ends[VICTIM - 1]
    return max(ends.values()) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("split", "init"), default="split")
    parser.add_argument("--ranks", default="4,8", help="comma-separated group sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--colors", choices=("one", "parity"), default="one", help="split(0) or split(rank %% 2)")
    parser.add_argument("--trees", default=f"this={ROOT}", help="name=path,... source trees to compare")
    args = parser.parse_args()
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    sizes = [int(s) for s in args.ranks.split(",")]
    times: dict[tuple[str, int], list[float]] = {(t, n): [] for t in trees for n in sizes}
    for _ in range(args.rounds):
        for n in sizes:
            for name, path in trees.items():
                times[(name, n)].append(one_round(path, n, args.case, args.colors))
    what = args.case if args.case == "init" else f"split ({args.colors} color)"
    print(f"{what}: seconds from the kill to the last survivor's error, {args.rounds} rounds"
          + (" (not counting rank 1, held back 1 s)" if args.case == "init" else ""))
    print("| ranks | " + " | ".join(f"{t} median | {t} max" for t in trees) + " |")
    print("|---|" + "---|---|" * len(trees))
    for n in sizes:
        cells = []
        for name in trees:
            values = times[(name, n)]
            cells += [f"{statistics.median(values):.2f}", f"{max(values):.2f}"]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
