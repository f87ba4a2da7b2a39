"""The ring's addresses: MLX_HOSTFILE (a JSON list, per rank, of the "ip:port" addresses it
listens on) read and checked, so every rank fails at once on a bad list instead of one rank
failing to listen while its neighbours wait out the connect deadline."""
from __future__ import annotations

import json

from ...errors import ConfigError
from ..transport import auth, tcp
from ..transport.names import check_resolvable


def load_ring_hostfile(path: str) -> list[list[str]]:
    """Read and validate MLX_HOSTFILE: a JSON list, per rank, of "ip:port" strings."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"MLX_HOSTFILE {path!r} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # bad JSON, undecodable bytes, absurd nesting
        raise ConfigError(f"MLX_HOSTFILE {path!r} is not valid JSON: {exc}") from None
    return validate_addresses(data, f"MLX_HOSTFILE {path!r}")


def validate_addresses(data: object, where: str) -> list[list[str]]:
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{where} must be a non-empty JSON list with one list of 'ip:port' per rank")
    for rank, entry in enumerate(data):
        if isinstance(entry, str):
            entry = data[rank] = [entry]
        if not isinstance(entry, list) or not entry:
            raise ConfigError(f"{where}: entry {rank} must be a non-empty list of 'ip:port' strings, got {entry!r}")
        for addr in entry:
            tcp.parse_address(addr, f"{where}: rank {rank} address")
    _reject_duplicates(data, where)
    for rank, entry in enumerate(data):
        for addr in entry:
            check_resolvable(tcp.parse_address(addr)[0], f"{where}: rank {rank} address {addr!r}")
    return data


def refuse_open_hosts(addresses: list[list[str]], where: str) -> None:
    """ConfigError when the hostfile names a host other than this one and no job secret is
    set (nor JACKLRING_ALLOW_UNAUTHENTICATED=1): without a secret the ring's key follows from
    the hostfile, which any user of any of its hosts can read or guess, so anyone there could
    join or inject. A hostfile of this host's own addresses keeps working without a secret."""
    if not auth.secret_needed_across_hosts():
        return
    foreign = sorted({host for entry in addresses for host, _ in map(tcp.parse_address, entry)
                      if not tcp.own_address(host)})
    auth.refuse_unauthenticated_hosts(f"{where} names hosts other than this one", foreign, "the hostfile", "ring")


def links_per_neighbour(addresses: list[list[str]]) -> int:
    """Every rank uses the same number of connections per neighbour pair: the fewest addresses."""
    return min(len(a) for a in addresses)


def ranks_on_this_host(addresses: list[list[str]], rank: int) -> int:
    """How many ranks share this rank's host (by their first addresses)."""
    return tcp.local_rank_count([a[0] for a in addresses], addresses[rank][0])


def _reject_duplicates(data: list[list[str]], where: str) -> None:
    """Two listeners on one ip:port cannot both exist: fail on every rank at once instead of
    one rank failing to listen while its neighbour waits out the connect deadline.
    Port 0 (any free port) may repeat."""
    owner: dict[tuple[str, int], int] = {}
    for rank, entry in enumerate(data):
        for addr in entry:
            host, port = tcp.parse_address(addr)
            if port == 0:
                continue
            first = owner.setdefault((host, port), rank)
            if first != rank or _listed_twice(entry, (host, port)):
                raise ConfigError(f"{where}: rank {first} and rank {rank} both listen on "
                                  f"{tcp.format_address((host, port))}; every address must be distinct")


def _listed_twice(entry: list[str], key: tuple[str, int]) -> bool:
    return sum(tcp.parse_address(a) == key for a in entry) > 1
