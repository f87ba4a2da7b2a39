"""Elastic data-parallel training: the digits MLP of data_parallel.py, carrying on when a rank dies.

    python examples/training/elastic.py --spawn 4 --kill 2:30     # 4 ranks; rank 2 is killed at step 30
    python examples/training/elastic.py --spawn 4 --kill 2:30 --replace   # ... and a replacement joins
    python examples/training/elastic.py --spawn 3                 # nobody dies
    launcher -n 4 --restart-failed 1 examples/training/elastic.py --kill 2:30 --replace

Each step every rank computes the gradient of its shard of the global batch and the ranks
average them (adapter.average_gradients). When a collective fails because a rank died
(PeerError) or stalled (CollectiveTimeout), the survivors call group.shrink(), which returns the
group of the ranks still alive, and carry on: the global batch is split among fewer ranks, so
every step still uses the whole batch. A rank may have finished the failed step (its last
collective completed while another rank's did not): after shrinking, the survivors take the
parameters and step count of the rank furthest ahead, so they stay identical. Plain SGD (no
momentum) keeps that state to the parameters.

With --replace the survivors then call group.grow(), which waits for a replacement process
(started with JACKLRING_JOIN=1 and the dead rank's MLX_RANK: --spawn starts one itself, the
launcher's --restart-failed does the same) and returns the group back at full size. The
replacement's init() returns that grown group; it takes part in the same hand-over as the
survivors, so it receives the current parameters and step from the rank furthest ahead
before its first step.

--spawn N starts N ranks on 127.0.0.1 itself (the ring backend), --kill R:S makes rank R
SIGKILL itself at global step S. Under the launcher without --restart-failed (or --min-ranks)
a death stops the whole job.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Run from a checkout without installing; first, since importing torch may load an installed
# jacklring as its device-backend plugin.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from data_parallel import accuracy, load_data, make_model  # noqa: E402

import adapter  # noqa: E402
from adapter.bench import free_ports  # noqa: E402
from adapter.gradients import average_gradients  # noqa: E402

FAILURES = (adapter.PeerError, adapter.CollectiveTimeout)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per step, over all ranks together")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spawn", type=int, default=0, metavar="N", help="start N ranks on this host")
    parser.add_argument("--kill", default=None, metavar="RANK:STEP", help="that rank SIGKILLs itself at that step")
    parser.add_argument("--replace", action="store_true",
                        help="after a death, grow back to full size with a replacement (--spawn starts it)")
    parser.add_argument("--grow-timeout", type=float, default=60.0,
                        help="how long the survivors wait for the replacement (s)")
    return parser.parse_args()


def recover(group: adapter.Group, model: torch.nn.Module, position: int,
            args: argparse.Namespace) -> tuple[adapter.Group, int]:
    """Shrink to the survivors (and with --replace grow back), then adopt the state of the one
    furthest ahead."""
    old_rank = group.rank()
    group = group.shrink()
    if group.rank() == 0:
        print(f"shrunk to {group.size()} rank(s) (old rank {old_rank} is rank 0 now)", flush=True)
    if args.replace:
        group = group.grow(timeout=args.grow_timeout)
        if group.rank() == 0:
            print(f"grew back to {group.size()} rank(s)", flush=True)
    return group, hand_over(group, model, position)


def hand_over(group: adapter.Group, model: torch.nn.Module, position: int) -> int:
    """Every rank takes the parameters and step of the rank furthest ahead (a replacement
    passes -1: it has nothing yet)."""
    positions = adapter.all_gather(np.array([position], np.int64), group=group)
    source = int(np.argmax(positions))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(adapter.broadcast(p.detach(), source, group=group))
    if group.rank() == 0:
        print(f"resuming at step {int(positions.max())} with {group.size()} rank(s)", flush=True)
    return int(positions.max())


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    victim, kill_step = (int(v) for v in args.kill.split(":")) if args.kill else (-1, -1)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = make_model(args.hidden, args.seed)
    joining = os.environ.get("JACKLRING_JOIN") == "1"  # a replacement: init() returns the grown group
    group = adapter.init()
    me = group.rank()  # the rank this process started as (for --kill; a replacement's is its new one)
    steps = -(-len(y_train) // args.global_batch)
    position = 0
    if joining:
        position = hand_over(group, model, -1)
        print(f"replacement (slot {os.environ.get('MLX_RANK')}) joined as rank {group.rank()} of "
              f"{group.size()} at step {position}", flush=True)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(adapter.broadcast(p.detach(), 0, group=group))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    while position < args.epochs * steps:
        epoch, step = divmod(position, steps)
        if me == victim and position == kill_step and not joining:
            os.kill(os.getpid(), signal.SIGKILL)
        order = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(len(y_train)))
        batch = order[step * args.global_batch:(step + 1) * args.global_batch]
        mine = torch.tensor_split(batch, group.size())[group.rank()]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x_train[mine]), y_train[mine], reduction="sum")
        (loss * (group.size() / len(batch))).backward()
        try:
            average_gradients(model, group=group)
        except FAILURES:
            group, position = recover(group, model, position, args)
            continue
        optimizer.step()
        position += 1
        if position % steps == 0 and group.rank() == 0:
            print(f"epoch {position // steps}  test accuracy {accuracy(model, x_test, y_test):.2%}  "
                  f"({group.size()} rank(s))", flush=True)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    try:  # every survivor ends with the same parameters
        sums = adapter.all_gather(np.array([checksum]), group=group)
        same = bool(np.all(sums == sums[0]))
    except FAILURES:
        same = False
    # One write per line: print() writes its pieces apart, and ranks sharing a terminal interleave them.
    start = f"a replacement in slot {os.environ['MLX_RANK']}" if joining else f"started as rank {me}"
    sys.stdout.write(f"rank {group.rank()} of {group.size()} ({start}): done, test accuracy "
                     f"{accuracy(model, x_test, y_test):.2%}, parameters identical on every rank: {same}\n")
    sys.stdout.flush()
    if not same:
        sys.exit(1)


def spawn(args: argparse.Namespace) -> int:
    """Start args.spawn ranks of this script on 127.0.0.1; 0 when every rank that was not
    killed finished."""
    victim = int(args.kill.split(":")[0]) if args.kill else -1
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(args.spawn)]))
        argv = list(sys.argv[1:])
        i = argv.index("--spawn")
        del argv[i:i + 2]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
        env.update(MLX_HOSTFILE=str(hostfile), JACKLRING_TIMEOUT=env.get("JACKLRING_TIMEOUT", "30"),
                   OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, *argv], env={**env, "MLX_RANK": str(r)})
                 for r in range(args.spawn)]
        if args.replace and victim >= 0:
            # As the launcher's --restart-failed does: once the victim is gone, start a process
            # in its slot that joins the survivors' grow().
            procs[victim].wait()
            procs.append(subprocess.Popen([sys.executable, __file__, *argv],
                                          env={**env, "MLX_RANK": str(victim), "JACKLRING_JOIN": "1"}))
        codes = [p.wait() for p in procs]
    expected = [-signal.SIGKILL if r == victim else 0 for r in range(args.spawn)]
    expected += [0] * (len(codes) - len(expected))
    print(f"exit codes {codes} (expected {expected})", flush=True)
    return 0 if codes == expected else 1


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(spawn(arguments) if arguments.spawn else train(arguments))
