"""A JACCL group that spans hosts needs a job secret, as a ring hostfile that does
(ring/addresses.refuse_open_hosts): without one the key follows from MLX_JACCL_COORDINATOR and
MLX_IBV_DEVICES, which every user of those hosts can read, so any of them could join or inject.

JACCL's environment names one address, the coordinator, so each rank sees a different part of
the picture: a rank whose coordinator is another host's address knows at once; rank 0 knows when
a side-channel connection arrives from another host. The first tells rank 0 by connecting once
(under the public key: nothing to lose) before it refuses, so rank 0 refuses at once too instead
of waiting out its deadline for a rank that will never come. A group whose ranks all reach the
coordinator from this host forms without a secret, as before."""
from __future__ import annotations

import time

from ...errors import DistributedError
from ..transport import auth, tcp
from .side_channel import PURPOSE_SIDE_CHANNEL

COURTESY_S = 3.0  # how long a rank that refuses tries to let rank 0 know

KEY_SOURCE = "MLX_JACCL_COORDINATOR and MLX_IBV_DEVICES"


def refuse_remote_coordinator(rank: int, coordinator: tuple[str, int], token: int, deadline: float,
                              job: auth.Auth) -> None:
    """A rank (not 0) whose coordinator is on another host, without a secret: ConfigError, after
    one connection to rank 0 so that it sees this host and refuses as well."""
    where = tcp.format_address(coordinator)
    if rank == 0 or job.secret or tcp.own_address(coordinator[0]) or not auth.secret_needed_across_hosts():
        return
    hello = tcp.Hello(PURPOSE_SIDE_CHANNEL, rank, 0, 0, token)
    try:
        sock = tcp.connect_with_hello(coordinator, hello, min(deadline, time.monotonic() + COURTESY_S),
                                      f"JACCL coordinator (rank 0, MLX_JACCL_COORDINATOR={where})", job)[0]
        sock.close()
    except DistributedError:
        pass  # rank 0 is not there (yet): it finds out from its own deadline
    auth.refuse_unauthenticated_hosts(f"rank {rank}: MLX_JACCL_COORDINATOR={where} names a host other than this "
                                      f"one", [coordinator[0]], KEY_SOURCE, "JACCL group")


def refuse_remote_peer(peer: int, host: str) -> None:
    """Rank 0: side-channel rank `peer` connected from `host`; ConfigError when that is another
    host's address and no secret is set (a group of this host's addresses forms without)."""
    if tcp.own_address(host):
        return
    auth.refuse_unauthenticated_hosts(f"rank 0: JACCL rank {peer} reached MLX_JACCL_COORDINATOR from a host "
                                      f"other than this one", [host], KEY_SOURCE, "JACCL group")
