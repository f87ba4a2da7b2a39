"""Several worker scripts in one rank process, one after the other, so that a launch pays the
import of torch once for all of them (tests/torch/test_torch_backend.py).

argv: RANK WORLD_SIZE PORT SCRIPT:PORT [SCRIPT:PORT ...]. Each script runs as if spawned alone
(argv RANK WORLD_SIZE ITS_PORT, as __main__), after a line "=== SCRIPT"; a script that raises
prints its traceback, then "=== SCRIPT FAILED", and the next one runs. Whatever group a script
leaves initialized is destroyed before the next forms its own, on a port of its own (a store
server a script still holds cannot take the next one's port). Exits 1 if any script failed."""
from __future__ import annotations

import gc
import os
import runpy
import sys
import traceback

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    rank, world = sys.argv[1], sys.argv[2]
    failed = 0
    for spec in sys.argv[4:]:
        script, port = spec.rsplit(":", 1)
        print(f"=== {script}", flush=True)
        sys.argv = [os.path.join(HERE, script), rank, world, port]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except BaseException:  # noqa: BLE001  (SystemExit and assertion errors alike)
            traceback.print_exc()
            print(f"=== {script} FAILED", flush=True)
            failed += 1
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        gc.collect()
        sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
