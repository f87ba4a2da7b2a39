"""The launcher hostfile: parsing, validation and serialisation.

Two forms are accepted (rank order = list order):

    [{"ssh": "host", "ips": ["1.2.3.4"], "rdma": [null, "rdma_en5"]}, ...]
    {"backend": "ring", "envs": ["K=V"], "hosts": [ ...same list... ]}

Every problem raises HostfileError with one line that names the source, the entry
index and the field, e.g. ``cluster.json: hosts[2].rdma: expected 4 entries ...``.

Stable API (the topology tool imports it): load_hostfile, parse_hostfile,
dump_hostfile, dumps_hostfile, hosts_from_list, check_backend, parse_ssh_target,
Hostfile, Host, SshTarget, HostfileError, BACKENDS.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

BACKENDS = ("ring", "jaccl", "jaccl-ring", "mpi", "nccl")

# One rdma cell: no link (null), one device name, or several devices (several cables).
RdmaCell = Union[None, str, list]

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")


class HostfileError(ValueError):
    """A hostfile (or --hosts list) that cannot be used; the message is one line."""


@dataclass(frozen=True)
class SshTarget:
    """Where to ssh: `[user@]host[:port]` (IPv6 as `[addr]:port`)."""

    host: str
    user: Optional[str] = None
    port: Optional[int] = None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and self.port is not None else self.host
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port is not None else ""
        return f"{user}{host}{port}"


@dataclass
class Host:
    ssh: str
    ips: list[str] = field(default_factory=list)
    rdma: list[RdmaCell] = field(default_factory=list)

    @property
    def target(self) -> SshTarget:
        return parse_ssh_target(self.ssh)

    @property
    def is_local(self) -> bool:
        """True when the rank runs here as a subprocess instead of through ssh.

        Like mlx.launch, only the loopback names count as local; a user or port in the
        target (`root@127.0.0.1:2222`) asks for ssh explicitly."""
        return self.ssh in _LOCAL_NAMES

    @property
    def address(self) -> str:
        """The address other ranks can reach this host at: first ip, else the ssh host."""
        return self.ips[0] if self.ips else self.target.host


@dataclass
class Hostfile:
    hosts: list[Host]
    backend: str = ""
    envs: list[str] = field(default_factory=list)


def parse_ssh_target(text: str) -> SshTarget:
    """Split `[user@]host[:port]`; `[v6addr]:port` for IPv6; a bare v6 address has no port."""
    if not isinstance(text, str) or not text.strip():
        raise HostfileError("ssh target must be a non-empty string")
    if any(c.isspace() for c in text):
        raise HostfileError(f"ssh target {text!r} contains whitespace")
    user, sep, rest = text.rpartition("@")
    if sep and not user:
        raise HostfileError(f"ssh target {text!r} has an empty user")
    port_text = None
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise HostfileError(f"ssh target {text!r}: malformed [address]:port")
        port_text = tail[1:] if tail else None
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    else:
        host = rest  # a name, an IPv4 address or a bare IPv6 address
    if not host:
        raise HostfileError(f"ssh target {text!r} has an empty host")
    port = None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise HostfileError(f"ssh target {text!r}: port must be 1-65535")
        port = int(port_text)
    return SshTarget(host=host, user=user or None, port=port)


def load_hostfile(path: Union[str, Path]) -> Hostfile:
    """Read and validate a JSON hostfile."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise HostfileError(f"{path}: cannot read hostfile ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise HostfileError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise HostfileError(
            f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    except RecursionError:
        raise HostfileError(f"{path}: malformed JSON: nested too deeply") from None
    return parse_hostfile(obj, source=str(path))


def parse_hostfile(obj: Any, source: str = "hostfile") -> Hostfile:
    """Validate an already decoded hostfile (either form)."""
    if isinstance(obj, list):
        backend, envs, entries, where = "", [], obj, "hosts"
    elif isinstance(obj, dict):
        unknown = sorted(set(obj) - {"backend", "envs", "hosts"})
        if unknown:
            raise HostfileError(
                f"{source}: unknown key {unknown[0]!r} (expected backend, envs, hosts)"
            )
        if "hosts" not in obj:
            raise HostfileError(f"{source}: missing 'hosts' (a list of host entries)")
        backend = obj.get("backend", "") or ""
        envs = obj.get("envs", [])
        entries = obj["hosts"]
        where = "hosts"
        if not isinstance(backend, str) or (backend and backend not in BACKENDS):
            raise HostfileError(
                f"{source}: backend: unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})"
            )
        _check_envs(envs, f"{source}: envs")
    else:
        raise HostfileError(
            f"{source}: expected a list of hosts or an object with 'hosts', got {_kind(obj)}"
        )
    if not isinstance(entries, list):
        raise HostfileError(f"{source}: {where or 'top level'}: expected a list, got {_kind(entries)}")
    if not entries:
        raise HostfileError(f"{source}: {where or 'top level'}: the host list is empty")

    hosts = [_parse_host(entry, f"{source}: {where}[{i}]") for i, entry in enumerate(entries)]
    hostfile = Hostfile(hosts=hosts, backend=backend, envs=list(envs))
    _check_rdma_matrix(hostfile, f"{source}: {where}")
    if backend:
        check_backend(hostfile, backend, source=source)
    return hostfile


def _parse_host(entry: Any, where: str) -> Host:
    if not isinstance(entry, dict):
        raise HostfileError(f"{where}: expected an object with 'ssh', got {_kind(entry)}")
    unknown = sorted(set(entry) - {"ssh", "ips", "rdma"})
    if unknown:
        raise HostfileError(f"{where}: unknown field {unknown[0]!r} (expected ssh, ips, rdma)")
    if "ssh" not in entry:
        raise HostfileError(f"{where}.ssh: missing (the host name to ssh into)")
    ssh = entry["ssh"]
    if not isinstance(ssh, str):
        raise HostfileError(f"{where}.ssh: expected a string, got {_kind(ssh)}")
    try:
        parse_ssh_target(ssh)
    except HostfileError as e:
        raise HostfileError(f"{where}.ssh: {e}") from None

    ips = entry.get("ips", [])
    if not isinstance(ips, list):
        raise HostfileError(f"{where}.ips: expected a list of IP addresses, got {_kind(ips)}")
    for j, ip in enumerate(ips):
        if not isinstance(ip, str):
            raise HostfileError(f"{where}.ips[{j}]: expected a string, got {_kind(ip)}")
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise HostfileError(f"{where}.ips[{j}]: {ip!r} is not an IP address") from None

    rdma = entry.get("rdma", [])
    if not isinstance(rdma, list):
        raise HostfileError(f"{where}.rdma: expected a list (one cell per host), got {_kind(rdma)}")
    for j, cell in enumerate(rdma):
        ok = cell is None or isinstance(cell, str) or (
            isinstance(cell, list) and cell and all(isinstance(d, str) for d in cell)
        )
        if not ok:
            raise HostfileError(
                f"{where}.rdma[{j}]: expected null, a device name or a non-empty list of names, got {_kind(cell)}"
            )
    return Host(ssh=ssh, ips=list(ips), rdma=list(rdma))


def _check_envs(envs: Any, where: str) -> None:
    if not isinstance(envs, list):
        raise HostfileError(f"{where}: expected a list of \"KEY=VALUE\" strings, got {_kind(envs)}")
    for j, item in enumerate(envs):
        if not isinstance(item, str) or "=" not in item:
            raise HostfileError(f"{where}[{j}]: expected \"KEY=VALUE\", got {item!r}")
        if not _ENV_KEY.match(item.split("=", 1)[0]):
            raise HostfileError(f"{where}[{j}]: {item.split('=', 1)[0]!r} is not a valid variable name")


def _check_rdma_matrix(hostfile: Hostfile, where: str) -> None:
    """If any host lists rdma devices, together they must form an N x N matrix, null diagonal."""
    n = len(hostfile.hosts)
    if not any(h.rdma for h in hostfile.hosts):
        return
    for i, h in enumerate(hostfile.hosts):
        if len(h.rdma) != n:
            raise HostfileError(
                f"{where}[{i}].rdma: expected {n} entries (one per host), got {len(h.rdma)}"
            )
        if h.rdma[i] is not None:
            raise HostfileError(
                f"{where}[{i}].rdma[{i}]: must be null (a host has no link to itself), got {h.rdma[i]!r}"
            )


def check_backend(hostfile: Hostfile, backend: str, source: str = "hostfile") -> None:
    """Raise if the hosts lack what `backend` needs (ring: ips everywhere, ...)."""
    if backend not in BACKENDS:
        raise HostfileError(f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})")
    if backend == "ring":
        for i, h in enumerate(hostfile.hosts):
            if not h.ips:
                raise HostfileError(
                    f"{source}: hosts[{i}].ips: the ring backend needs at least one IP per host "
                    f"({h.ssh!r} has none)"
                )
    if backend in ("jaccl", "jaccl-ring", "nccl") and not hostfile.hosts[0].ips:
        raise HostfileError(
            f"{source}: hosts[0].ips: the {backend} backend needs an IP for rank 0 that every rank can reach"
        )


def hosts_from_list(hosts: str, repeat: int = 1) -> Hostfile:
    """`--hosts a,b -n 2` -> a, a, b, b (like mlx.launch); an IP host is also its own ip."""
    if repeat < 1:
        raise HostfileError(f"-n/--repeat-hosts must be positive, got {repeat}")
    result = []
    for i, name in enumerate(hosts.split(",")):
        name = name.strip()
        if not name:
            raise HostfileError(f"--hosts: entry {i} is empty")
        try:
            target = parse_ssh_target(name)
        except HostfileError as e:
            raise HostfileError(f"--hosts: entry {i}: {e}") from None
        ips = [target.host] if _is_ip(target.host) else []
        if name == "localhost":
            ips = ["127.0.0.1"]
        result.extend(Host(ssh=name, ips=list(ips)) for _ in range(repeat))
    return Hostfile(hosts=result)


def dump_hostfile(hostfile: Hostfile) -> dict:
    """The object form, ready for json.dump; parse_hostfile(dump_hostfile(h)) == h."""
    out: dict = {}
    if hostfile.backend:
        out["backend"] = hostfile.backend
    if hostfile.envs:
        out["envs"] = list(hostfile.envs)
    out["hosts"] = [{"ssh": h.ssh, "ips": list(h.ips), "rdma": list(h.rdma)} for h in hostfile.hosts]
    return out


def dumps_hostfile(hostfile: Hostfile) -> str:
    return json.dumps(dump_hostfile(hostfile), indent=2) + "\n"


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
