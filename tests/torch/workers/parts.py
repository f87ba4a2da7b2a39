"""Several worker scripts in one rank process, one after the other, so that a launch pays the
import of torch once for all of them (tests/torch/test_three_rank_launch.py).

argv: RANK WORLD_SIZE PORT PART [PART ...], each PART "SCRIPT:PORT" or "SCRIPT:PORT:ARG". Each
script runs as if spawned alone (argv RANK WORLD_SIZE ITS_PORT [ARG], as __main__, in the
environment this process started with), after a line "=== SCRIPT [ARG]"; a script that raises
prints its traceback, then "=== SCRIPT [ARG] FAILED", and the next one runs. Whatever group a
script leaves initialized is destroyed before the next forms its own, on a port of its own (a
store server a script still holds cannot take the next one's port); after the last part nothing
is destroyed (a part may leave a group that cannot close cleanly, as it would alone). Exits 1 if
any script failed."""
from __future__ import annotations

import gc
import os
import runpy
import sys
import traceback

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    rank, world, parts = sys.argv[1], sys.argv[2], sys.argv[4:]
    environ = dict(os.environ)
    failed = 0
    for i, spec in enumerate(parts):
        script, port, *arg = spec.split(":", 2)
        name = " ".join([script, *arg])
        print(f"=== {name}", flush=True)
        sys.argv = [os.path.join(HERE, script), rank, world, port, *arg]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except BaseException:  # noqa: BLE001  (SystemExit and assertion errors alike)
            traceback.print_exc()
            print(f"=== {name} FAILED", flush=True)
            failed += 1
        sys.stdout.flush()
        if i == len(parts) - 1:
            break
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        os.environ.clear()
        os.environ.update(environ)  # lifecycle.py sets env:// variables
        gc.collect()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
