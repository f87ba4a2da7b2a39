"""compiled_variants.py then compiled_ddp.py in one process group (argv extra: the process group
backend, the compile backend, then "shrink" for compiled_ddp's shrink_group at the end), each
part's output after a line "=== VARIANTS" / "=== DDP". One launch per backend serves both tests
of tests/torch/test_compile.py: each rank imports torch and warms Dynamo up once, not twice."""
from __future__ import annotations

import sys

import compiled_ddp
import compiled_variants
from common import extra, init


def main() -> None:
    backend = next((a for a in sys.argv[1:] if a in ("jacklring", "gloo")), "jacklring")
    compiler = next((a for a in sys.argv[1:] if a in ("eager", "aot_eager", "inductor")), "eager")
    rank, world = init(backend=backend)
    print("=== VARIANTS", flush=True)
    compiled_variants.run(rank, world, compiler)
    print("=== DDP", flush=True)
    compiled_ddp.run(rank, world, extra())  # last: its shrink_group leaves a rank out
    compiled_ddp.finish(backend)


if __name__ == "__main__":
    main()
