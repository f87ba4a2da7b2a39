"""init_process_group("cpu:jacklring,cuda:nccl"): what the other half of a device pairing gets.

torch builds one backend per device of the string, but stops at a backend that returns a whole
ProcessGroup, as jacklring does: the jacklring group then serves every device and the other
backend is never created, nor checked. gloo's pairing on a CPU-only torch says "Distributed
package doesn't have NCCL built in"; jacklring's said nothing. This says the same, and warns
when a pairing that could be built is not used.
"""
from __future__ import annotations

import sys
import warnings

from ..errors import ConfigError

_AVAILABLE = {"nccl": "is_nccl_available", "gloo": "is_gloo_available", "mpi": "is_mpi_available",
              "ucc": "is_ucc_available", "xccl": "is_xccl_available"}


def device_backends(depth: int = 6) -> dict[str, str]:
    """{device: backend} of the group torch is creating, read from torch's frame that calls the
    creator (_new_process_group_helper's BackendConfig); {} when it cannot be found."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        config = frame.f_locals.get("backend_config")
        if config is not None and hasattr(config, "get_device_backend_map"):
            try:
                return {str(k): str(v).lower() for k, v in config.get_device_backend_map().items()}
            except Exception:  # a torch whose BackendConfig differs: nothing to check
                return {}
        frame = frame.f_back
    return {}


def check_pairing(rank: int, devices: dict[str, str], own: str) -> None:
    """Raise ConfigError (a RuntimeError) when a device is paired with a backend this torch build
    lacks; warn when it is paired with one that exists, since jacklring (registered as `own`)
    serves that device."""
    import torch.distributed as dist

    for device, backend in sorted(devices.items()):
        if backend == own:
            continue
        spec = ",".join(f"{d}:{b}" for d, b in devices.items())
        available = getattr(dist, _AVAILABLE.get(backend, ""), None)
        if available is not None and not available():
            raise ConfigError(
                f"rank {rank}: init_process_group({spec!r}) pairs {device} tensors with {backend}, but "
                f"Distributed package doesn't have {backend.upper()} built in (this torch build); use "
                f"\"{own}\" alone, which runs {device} tensors too")
        warnings.warn(f"rank {rank}: init_process_group({spec!r}): the {own} process group serves "
                      f"{device} tensors too, so {backend} is not used (torch stops at a backend that is a "
                      "whole process group)", RuntimeWarning, stacklevel=3)
