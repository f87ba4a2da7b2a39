"""What `import torch` changes in a gloo program: the environment and the threads before and
after, then a gloo all_reduce so the program is a real gloo job.

    import_side_effects.py INIT_METHOD     INIT_METHOD: "env://" (torchrun) or tcp://host:port
                                           (mpirun: rank and size from OMPI_COMM_WORLD_*)
prints one line: RESULT {"rank": r, "env_added": {...}, "env_changed": {...}, "env_removed": [...],
                         "threads_added": [...] (Python threads), "native_threads_added": n (every
                         thread of the process), "sockets_added": n, "backends": [...], "sum": s}
"""
import json
import os
import sys
import threading


def sockets() -> set[str]:
    """This process's open sockets (Linux: /proc/self/fd links "socket:[inode]")."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed by now
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def native_threads() -> int:
    """Threads of this process, also those Python does not know (C++, OpenMP)."""
    return len(os.listdir("/proc/self/task"))


before_env = dict(os.environ)
before_threads = {t.name for t in threading.enumerate()}
before_native, before_sockets = native_threads(), sockets()

import torch  # noqa: E402  (the import under test)
import torch.distributed as dist  # noqa: E402

after_env = dict(os.environ)
after_threads = {t.name for t in threading.enumerate()}
after_native, after_sockets = native_threads(), sockets()

init_method = sys.argv[1]
if init_method == "env://":
    dist.init_process_group("gloo")
else:
    dist.init_process_group("gloo", init_method=init_method, rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                            world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
fields = {
    "rank": dist.get_rank(),
    "env_added": {k: v for k, v in after_env.items() if k not in before_env},
    "env_changed": {k: v for k, v in after_env.items() if k in before_env and before_env[k] != v},
    "env_removed": sorted(k for k in before_env if k not in after_env),
    "threads_added": sorted(after_threads - before_threads),
    "native_threads_added": after_native - before_native,
    "sockets_added": len(after_sockets - before_sockets),
    "backends": sorted(dist.Backend.backend_list),
    "sum": float(t[0]),
}
dist.destroy_process_group()
# One write of less than PIPE_BUF: ranks sharing a pipe never split it.
sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
sys.stdout.flush()
