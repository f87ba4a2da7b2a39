"""A torch "jacklring" group formed through the store (tcp://), then a subgroup that asks for a
backend the store ring stands in for, under a program that set the root logger to INFO (as Ray's
workers and many training scripts do). Prints every record below WARNING that jacklring's loggers
emitted: LOGGING {"records": [...], "root_handlers_added": n}, then "LOGGING OK"."""
from __future__ import annotations

import json
import logging
import sys

logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
root_handlers_before = len(logging.getLogger().handlers)


class BelowWarning(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING:
            self.records.append(f"{record.levelname}:{record.name}:{record.getMessage()}")


captured = BelowWarning()
logging.getLogger("jacklring").addHandler(captured)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import init  # noqa: E402

from adapter.torch_backend import JacklringOptions  # noqa: E402

rank, world = init(timeout_s=30.0)
sub = dist.new_group(list(range(world)), pg_options=JacklringOptions(backend="mpi"))
t = torch.ones(1)
dist.all_reduce(t)
dist.all_reduce(t, group=sub)
assert t.item() == world * world, t
dist.destroy_process_group()
sys.stdout.write("LOGGING " + json.dumps({"records": captured.records,
                                          "root_handlers_added": len(logging.getLogger().handlers)
                                          - root_handlers_before}) + "\n")
print("LOGGING OK", flush=True)
