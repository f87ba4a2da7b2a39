"""Load the recorded command outputs in fixtures/*.json and turn them into HostFacts
exactly as launcher-config does with live ssh output (same section framing, same parsers)."""
from __future__ import annotations

import json
from pathlib import Path

from launcher.config.discovery import SECTION_MARK, HostFacts, parse_access, parse_probe

FIXTURES = Path(__file__).parent / "fixtures"

ACCESS_SECTIONS = ("uname", "uid", "ssh_connection", "sudo")
PROBE_SECTIONS = ("system_profiler", "hardware_ports", "ibv_devices", "ipconfig", "ip_addr", "ip_link", "rdma")


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def framed(host: dict, sections: tuple[str, ...]) -> str:
    """The stdout a probe script prints: a marker line, then each command's output."""
    out = []
    for section in sections:
        if section not in host:
            continue
        body = host[section]
        if not isinstance(body, str):
            body = json.dumps(body, indent=2)
        out.append(f"{SECTION_MARK}{section}\n{body.rstrip()}")
    return "\n".join(out) + "\n"


def host_facts(name: str) -> list[HostFacts]:
    facts = []
    for host in load(name)["hosts"]:
        access = parse_access(framed(host, ACCESS_SECTIONS))
        facts.append(parse_probe(host["ssh"], access, framed(host, PROBE_SECTIONS)))
    return facts
