"""CUDA devices as the NCCL backend sees them: is one visible, how many, which one this rank
uses. (DeviceBuffer, the description of device memory a backend takes, is part of the backend
contract: adapter.backends.base.)

Imports neither cupy nor torch at module level: probe() runs on every init() of a CPU job.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys
from typing import Mapping

from ... import config
from ...errors import ConfigError

_HIDDEN = ("", "-1", "none", "NoDevFiles")


def cuda_visible_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """None when a CUDA device may be visible, else why not. Cheap: reads the environment and
    /dev only."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in _HIDDEN:
        return f"no CUDA device visible (CUDA_VISIBLE_DEVICES={visible!r})"
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg") or shutil.which("nvidia-smi"):
        return None
    return "no CUDA device visible (no /dev/nvidia* device and no nvidia-smi)"


def device_count() -> int:
    """CUDA devices this process can use; 0 on any failure (no driver, no library). Never raises."""
    if cuda_visible_reason() is not None:
        return 0
    order = ("torch", "cupy") if "torch" in sys.modules else ("cupy", "torch")
    for name in order:
        try:
            if name == "cupy":
                import cupy

                return int(cupy.cuda.runtime.getDeviceCount())
            import torch

            if torch.cuda.is_available():
                return int(torch.cuda.device_count())
        except Exception:  # noqa: BLE001 - no driver, wrong CUDA, library absent: all mean zero
            continue
    return 0


LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def choose_device(rank: int, count: int, environ: Mapping[str, str] | None = None) -> int:
    """This rank's device ordinal among the visible ones: JACKLRING_CUDA_DEVICE if set, else the
    local rank (LOCAL_RANK or the MPI / Slurm equivalents, else the global rank) modulo the
    number of visible devices. A launcher that gives each rank its own CUDA_VISIBLE_DEVICES
    makes this 0 everywhere."""
    env = os.environ if environ is None else environ
    if count < 1:
        raise ConfigError(f"rank {rank}: no CUDA device visible (CUDA_VISIBLE_DEVICES="
                          f"{env.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})")
    device = config.get("JACKLRING_CUDA_DEVICE", env)
    if device is not None:
        if not 0 <= device < count:
            raise ConfigError(f"rank {rank}: JACKLRING_CUDA_DEVICE={device} but only {count} "
                              f"device(s) are visible")
        return device
    local = rank
    for name in LOCAL_RANK_VARIABLES:
        raw = env.get(name)
        if raw:
            try:
                local = int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None
            break
    return local % count
