"""One rank of test_nccl_id_store: `nccl_id_rank.py RANK PORT:SECRET[:ID_HEX]...` runs the exchanges in turn
(one process for them all: torch is imported once) and prints one JSON line for each."""
import datetime
import json
import sys

import torch.distributed as dist

from adapter.backends.transport import auth
from adapter.errors import DistributedError
from adapter.rendezvous.nccl_id import exchange_id_via_store

rank = int(sys.argv[1])
for exchange in sys.argv[2:]:  # PORT:SECRET[:ID_HEX]
    port, secret, *the_id = exchange.split(":")
    made = bytes.fromhex(the_id[0]) if the_id else bytes(range(128))
    store = dist.TCPStore("127.0.0.1", int(port), 4, False, datetime.timedelta(seconds=30))
    job = auth.auth_from_secret(bytes.fromhex(secret))
    try:
        got = exchange_id_via_store(store, "pg0/nccl_id", rank, 3, lambda: made, job, 20)
        print(json.dumps({"rank": rank, "id": got.hex()}), flush=True)
    except DistributedError as exc:
        print(json.dumps({"rank": rank, "error": type(exc).__name__, "text": str(exc)}), flush=True)
