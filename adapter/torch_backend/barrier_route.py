"""`torch.distributed.monitored_barrier` on jacklring groups without the user's help.

torch's function refuses every backend but gloo before it reaches the process group ("only
implemented for GLOO backend"), so a library calling it on a jacklring group failed although
the group implements the barrier. When the first jacklring process group forms (never at
import: registration must not change torch for programs that use gloo), torch's function is
replaced by one that runs jacklring's barrier on jacklring groups and torch's own on every
other group. JACKLRING_TORCH_MONITORED_BARRIER=0 leaves torch's function alone. A module that
did `from torch.distributed import monitored_barrier` before the first group formed keeps
torch's function; adapter.torch_backend.monitored_barrier works everywhere.
"""
from __future__ import annotations

from typing import Callable

from .. import config

SETTING = "JACKLRING_TORCH_MONITORED_BARRIER"


def route_on_first_group(route: Callable[[], None]) -> bool:
    """Call `route` (idempotent) unless the setting turns routing off; True when routed."""
    if not config.get(SETTING):
        return False
    route()
    return True
