"""Every JACKLRING_* setting, declared once: name, parser, default and meaning.

Settings are read when they are used, never at import, so a malformed value fails the call
that needs it with a ConfigError naming the variable, and never breaks `import adapter` or
`is_available()`. docs/environment.md lists the same table (a test keeps the two in step).
The MLX_* contract variables are the backends' own business: they belong to the environment
contract shared with MLX and its launcher, not to our settings.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from jacklring_shared.ports import port_range

from .errors import ConfigError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CONNECT_TIMEOUT_S = 120.0
# Sockets and poll() overflow past a few weeks; a longer deadline is a typo, not a plan.
MAX_SECONDS = 1e6


def check_seconds(value: float, what: str) -> float:
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ConfigError(f"{what} must be a number of seconds in (0, {MAX_SECONDS:.0f}]")
    return value


# ---- parsers: text -> value, ValueError with a short reason on bad input -------------------

def seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number of seconds") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ValueError(f"must be a number of seconds in (0, {MAX_SECONDS:.0f}]")
    return value


def seconds_or_off(raw: str) -> float | None:
    """A number of seconds, or 0 for "off"."""
    try:
        if float(raw) == 0:
            return None
    except ValueError:
        pass
    return seconds(raw)


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def byte_size(raw: str) -> int:
    """Bytes: 65536, 64K, 64KiB, 1M, 1G (binary multiples, as memory sizes usually are)."""
    match = _SIZE.match(raw)
    if not match:
        raise ValueError("is not a size in bytes (e.g. 65536, 64K, 1MiB, 1G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2).lower()]
    return int(match.group(1)) * scale


def integer(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError("is not an integer") from None
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return value
    return parse


def flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("is not a flag (1/0, true/false, yes/no, on/off)")


def choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError(f"choose one of {', '.join(options)}")
        return value
    return parse


def microseconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number of microseconds") from None
    if not 0 <= value <= 1e6:
        raise ValueError("must be between 0 and 1000000 microseconds")
    return value


# JACKLRING_ALGORITHM: the schedules each collective may be forced to (backends/algorithms/
# selection.py chooses among them otherwise). native: the backend's own schedule.
ALGORITHM_NAMES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("auto", "native", "rd", "rh"),
    "all_gather": ("auto", "native", "rd"),
    "reduce_scatter": ("auto", "native", "rh"),
    "broadcast": ("auto", "native", "tree"),
    "barrier": ("auto", "native", "dissemination"),
}


def algorithm_overrides(raw: str) -> dict[str, str]:
    """JACKLRING_ALGORITHM: comma-separated collective=schedule pairs, e.g. all_reduce=rd,broadcast=tree."""
    forced: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        name, sep, value = (part.strip().lower() for part in item.partition("="))
        if not sep or name not in ALGORITHM_NAMES:
            raise ValueError(f"has {item.strip()!r}: give collective=schedule pairs, the collective one of "
                             f"{', '.join(ALGORITHM_NAMES)}")
        if value not in ALGORITHM_NAMES[name]:
            raise ValueError(f"has {name}={value!r}: {name} takes one of {', '.join(ALGORITHM_NAMES[name])}")
        if name in forced:
            raise ValueError(f"names {name} twice")
        forced[name] = value
    return forced


def text(raw: str) -> str:
    return raw.strip()


def verify_mode(raw: str) -> str | bool:
    """JACKLRING_VERIFY: False (off), "crc" (1, crc) or "mac"."""
    value = raw.strip().lower()
    if value == "mac":
        return "mac"
    if value == "crc":
        return "crc"
    try:
        return "crc" if flag(value) else False
    except ValueError:
        raise ValueError("choose one of 0, 1, crc, mac") from None


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    default: Any
    meaning: str


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    # deadlines and diagnostics (every backend)
    Setting("JACKLRING_TIMEOUT", seconds, DEFAULT_TIMEOUT_S,
            "per-operation deadline in seconds, measured as silence: an operation fails when no byte has "
            "moved for that long (JACCL: no frame of up to 1 MiB), so a slow but live link is not a dead "
            "peer; init(timeout=...) and torch's timeout take precedence"),
    Setting("JACKLRING_CONNECT_TIMEOUT", seconds, DEFAULT_CONNECT_TIMEOUT_S,
            "deadline in seconds for forming a group (connecting to every peer)"),
    Setting("JACKLRING_STALL_REPORT", seconds_or_off, 30.0,
            "log once which peer an operation waits for after this many seconds; 0 turns it off"),
    Setting("JACKLRING_VERIFY", verify_mode, False,
            "1/crc: a CRC-32C after every message, checked on receipt (accidents, not attackers); "
            "mac: a keyed BLAKE3 tag with the job secret (attackers too)"),
    # authentication (docs/security.md)
    Setting("JACKLRING_SECRET", text, None,
            'the job secret (hex of 16+ bytes, or a passphrase of 16+ bytes and an estimated 80+ bits: '
            'docs/security.md), the same on every rank; the launcher sets it'),
    Setting("JACKLRING_SECRET_FILE", text, None,
            "path of a file (mode 0600) holding the job secret, when JACKLRING_SECRET is not set"),
    Setting("JACKLRING_REQUIRE_AUTH", flag, False,
            "refuse to form a group without a job secret (no connections authenticated by public facts only)"),
    Setting("JACKLRING_ALLOW_UNAUTHENTICATED", flag, False,
            "trusted networks only: a store ring without a job secret shares its key through torch's store "
            "(readable by anyone who reaches it) instead of deriving one or refusing a group that spans hosts"),
    # elastic groups (docs/faults.md)
    Setting("JACKLRING_JOIN", flag, False,
            "1: this process replaces a rank of a running ring or JACCL group instead of forming one: init() "
            "listens at its MLX_HOSTFILE slot (MLX_RANK, a vacant one such as a dead rank's), or under "
            "torchrun-style variables or Slurm knocks in the group's store at its RANK / SLURM_PROCID slot, or "
            "under JACCL's variables (the TCP mesh; MLX_RANK a vacant rank other than 0) knocks at "
            "MLX_JACCL_COORDINATOR, and waits up to JACKLRING_CONNECT_TIMEOUT for the members to take it in "
            "with Group.grow(); the launcher's --restart-failed sets it"),
    # ring
    Setting("JACKLRING_ALGORITHM", algorithm_overrides, {},
            "force a collective's schedule between hosts (ring and JACCL mesh), e.g. all_reduce=rd,broadcast=tree: "
            "all_reduce auto/native/rd/rh, all_gather auto/native/rd, reduce_scatter auto/native/rh, broadcast "
            "auto/native/tree, barrier auto/native/dissemination; unset: chosen by size and group size "
            "(docs/algorithms.md)"),
    Setting("JACKLRING_RING_SMALL_BYTES", byte_size, 64 * 1024,
            "largest reduction sent by the one-pass small-message path"),
    Setting("JACKLRING_RING_ONE_PASS_BYTES", byte_size, None,
            "with more than 2 ranks, the one-pass path only while it sends at most this much per rank "
            "((ranks - 1) x message), else reduce-scatter + all-gather; default 32 KiB, or no limit below "
            "JACKLRING_RING_SMALL_BYTES when every rank is on one host (latency-bound there)"),
    Setting("JACKLRING_RING_SEGMENT_BYTES", byte_size, 256 * 1024,
            "pipelining segment of large ring reductions"),
    Setting("JACKLRING_RING_DIRECTIONS", integer(1, 2), 2,
            "run large reductions over both ring directions (2) or one (1)"),
    Setting("JACKLRING_LOCAL_TRANSPORT", choice("auto", "shm", "unix", "tcp"), "auto",
            'how ranks on one host connect: auto/shm (collectives over shared memory between the ranks of a host:'
            " in stages when the group spans hosts and some host has several of its ranks, for the ring and"
            " JACCL alike; Unix "
            "sockets for the rest), unix (abstract Unix sockets on Linux) or tcp; JACCL's TCP mesh uses Unix "
            'sockets only with unix, and its collectives stay on the mesh with unix or tcp'),
    Setting("JACKLRING_SHM_CHUNK_BYTES", byte_size, 2 << 20,
            "shared-memory buffer per rank and step (the segment is 2 x ranks x this)"),
    Setting("JACKLRING_SHM_YIELD_US", microseconds, 1000.0,
            "after spinning, how long a rank waiting on shared memory keeps checking while giving its CPU "
            "away (sched_yield) before it sleeps; default 1000 us (with more ranks than CPUs, none for 250 ms after a "
            "yield that kept the CPU away 1 ms while work outside the job could fill the CPUs)"),
    Setting("JACKLRING_SHM_SMALL_BYTES", byte_size, 128 * 1024,
            "largest shared-memory all_reduce in which every rank reduces the whole message itself"),
    Setting("JACKLRING_P2P_SPILL_BYTES", byte_size, 1 << 30,
            "most bytes per peer read ahead (ring send/recv, JACCL TCP mesh) while nobody waits for them, so "
            "two ranks sending large messages to each other before receiving do not deadlock"),
    Setting("JACKLRING_SOCKET_BUFFER_BYTES", byte_size, 4 << 20,
            "send and receive buffer size requested for every TCP connection"),
    Setting("JACKLRING_NO_NATIVE", flag, False,
            "1: install without the native shared-memory engine, or do not use it at run time; same-host ranks "
            "then use sockets (one warning line)"),
    Setting("JACKLRING_SPIN_US", microseconds, None,
            "how long a waiting rank busy-polls before sleeping; sockets: default 50 us, 0 when ranks outnumber "
            "CPUs; shared memory: default 1 us of pause instructions (then it yields the CPU while checking), 0 with more "
            "than two ranks per CPU"),
    # JACCL
    Setting("JACKLRING_JACCL_TRANSPORT", choice("auto", "tcp", "rdma"), "auto",
            "JACCL's links: RDMA when every rank has its devices (auto), always the TCP mesh, or RDMA only"),
    Setting("JACKLRING_IBV_GID_INDEX", integer(0, 1 << 16), None,
            "RDMA GID index; default the first IPv4-mapped GID (RoCE v2)"),
    # MPI
    Setting("JACKLRING_MPI_MAX_COUNT", integer(1, 2**31 - 1), 2**31 - 1,
            "largest element count of one MPI call; larger buffers go as several calls"),
    # NCCL and CUDA buffers
    Setting("JACKLRING_CUDA_DEVICE", integer(0, 1 << 16), None,
            "CUDA device ordinal of this rank; default the local rank modulo the visible devices"),
    Setting("JACKLRING_NCCL_SPLIT", choice("nccl", "bootstrap"), "nccl",
            "how NCCL sub-groups form: ncclCommSplit, or a fresh bootstrap over TCP"),
    Setting("JACKLRING_PINNED_CACHE_BYTES", byte_size, 1 << 30,
            "pinned host memory kept for staging CUDA buffers through the host"),
    # torch process group
    Setting("JACKLRING_TORCH_BACKEND", choice("auto", "ring", "jaccl", "mpi", "nccl"), "auto",
            "what the torch process group runs on; auto: the launcher's backend, else a ring formed through the store"),
    Setting("JACKLRING_TORCH_NATIVE", choice("auto", "0", "1"), "auto",
            "auto: the torch process group is the C++ c10d Backend (built by scripts/setup.sh) where its ranks share "
            "memory and its cached build loads (all-reduce, all-gather, reduce-scatter, broadcast and barrier run in "
            "C++, everything else in the Python group behind it), else the Python group (warning when the build does "
            "not load); 1: the C++ Backend wherever its build loads (warning when it does not); 0: the Python group "
            "alone (docs/torch.md, 'The C++ Backend')"),
    Setting("JACKLRING_TORCH_MONITORED_BARRIER", flag, True,
            "torch.distributed.monitored_barrier answers on jacklring groups (routed when the first group forms); "
            "0 leaves torch's function alone"),
    Setting("JACKLRING_TORCH_HOST", text, None,
            "address the torch process group's ring listens on; default the address that reaches MASTER_ADDR"),
    # engines (adapter/engines.py)
    Setting("JACKLRING_LOCAL_PORTS", port_range, None,
            "LOW-HIGH: the range the launcher and the benchmark draw free ports from for jobs on one host; "
            "default below the kernel's ephemeral range"),
    Setting("JACKLRING_SLURM_PORT", integer(1, 65535), None,
            "port task 0 of an srun step serves the rendezvous on; default the step's reserved port, "
            "else one derived from the job and step ids"),
)}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The setting's value now (from os.environ, or the mapping given): its default when unset
    or empty, else the parsed value; ConfigError naming the variable when it is malformed."""
    setting = SETTINGS[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return setting.default
    try:
        return setting.parse(raw.strip())
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} {exc}") from None


def env_rank(world_size: int | None = None, layout: str | None = None) -> int:
    """MLX_RANK as an int, checked against the world size when one is known. `layout` names
    where that size comes from (`MLX_HOSTFILE '/path'`): then a launcher's own count of the
    ranks it started (WORLD_SIZE beside RANK = MLX_RANK, as our launcher sets them) must
    agree, so that a layout with fewer entries than started ranks fails on every rank, not
    only on the ranks beyond it (rank 0 would otherwise run alone as a group of one)."""
    raw = os.environ.get("MLX_RANK")
    if raw is None:
        raise ConfigError("MLX_RANK is not set")
    try:
        rank = int(raw)
    except ValueError:
        raise ConfigError(f"MLX_RANK={raw!r} is not an integer") from None
    started = _launcher_world_size(rank)
    where = f": {layout} lists {world_size} rank{'s' if world_size != 1 else ''}" if layout else ""
    if layout and started is not None:
        where += f", the launcher started {started} (WORLD_SIZE={started})"
    if rank < 0 or (world_size is not None and rank >= world_size):
        bound = f" (world size {world_size}{where})" if world_size is not None else ""
        raise ConfigError(f"MLX_RANK={rank} is out of range{bound}")
    if layout and started is not None and started != world_size:
        raise ConfigError(f"rank {rank}: the launcher started {started} ranks (WORLD_SIZE={started}) but "
                          f"{layout} lists {world_size}: every rank needs its own entry")
    return rank


def _launcher_world_size(rank: int) -> int | None:
    """WORLD_SIZE when the same launcher set it: RANK is set and equals MLX_RANK."""
    raw_size, raw_rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    if raw_size is None or raw_rank != str(rank):
        return None
    try:
        return int(raw_size)
    except ValueError:
        return None  # torchrun's own variables are checked where torchrun's engine is chosen


def op_timeout(explicit: float | None = None) -> float:
    """Per-operation deadline: the init() argument, else JACKLRING_TIMEOUT, else 300 s."""
    if explicit is not None:
        return check_seconds(float(explicit), f"timeout={explicit!r}")
    return get("JACKLRING_TIMEOUT")


def connect_timeout(explicit: float | None = None) -> float:
    """Deadline for forming the group: JACKLRING_CONNECT_TIMEOUT, else 120 s."""
    if explicit is not None:
        return check_seconds(float(explicit), f"connect_timeout={explicit!r}")
    return get("JACKLRING_CONNECT_TIMEOUT")
