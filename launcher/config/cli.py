"""`launcher-config`: find how the hosts are cabled, check it suits a backend, set up the
links and write the hostfile `launcher` runs with (our counterpart of mlx.distributed_config).

Steps, each a function below: read the host list -> check ssh and sudo on every host ->
ask each host about its hardware -> build the cable graph -> pick/check the backend ->
plan one subnet per cable -> apply or print the commands -> write the hostfile.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import dataclass

from ..hostfile import Hostfile, HostfileError, dumps_hostfile, hosts_from_list, load_hostfile
from .discovery import LINUX_PROBE, MACOS_PROBE, HostFacts, ProbeError, parse_probe
from .netplan import DEFAULT_SUBNET, PlanError, check_no_clash, format_commands, host_commands, plan_addresses
from .output import (
    OutputError,
    ethernet_hostfile,
    jaccl_hostfile,
    jaccl_ring_hostfile,
    lan_rdma_device,
    ring_hostfile,
    to_dot,
)
from .ssh import DEFAULT_COMMAND_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, HostAccess, RemoteHosts, SshError
from .topology import (
    Topology,
    TopologyError,
    explain_no_mesh,
    explain_no_ring,
    find_ring,
    from_thunderbolt,
    is_full_mesh,
    mesh_connections,
)

BACKEND_CHOICES = ("ring", "jaccl", "jaccl-ring")
EXIT_ERROR = 2


class UsageError(ValueError):
    """The request cannot be carried out; one line for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        self.exit(EXIT_ERROR, f"launcher-config: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="launcher-config",
                description="Discover how the hosts are connected (Thunderbolt cables or a LAN), "
                            "check the topology suits a backend, set up the links and write a "
                            "hostfile for `launcher`.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hosts", help="comma-separated ssh targets, [user@]host[:port]")
    src.add_argument("--hostfile", help="a launcher hostfile whose hosts (ssh names) to use")
    p.add_argument("--over", choices=("thunderbolt", "ethernet"), default="thunderbolt",
                   help="what carries the traffic (default: thunderbolt)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                   help="backend to configure (default: the best the hardware supports: jaccl on an "
                        "RDMA mesh, jaccl-ring on an RDMA ring, else ring)")
    p.add_argument("--auto-setup", dest="auto_setup", action=argparse.BooleanOptionalAction, default=False,
                   help="run the link setup commands on the hosts through `sudo -n` "
                        "(default: print them per host)")
    p.add_argument("--dot", action="store_true", help="print the topology as Graphviz DOT and stop")
    p.add_argument("--output", metavar="FILE", help="write the hostfile here (default: print it)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="environment variable for the job, stored in the hostfile (repeatable)")
    p.add_argument("--ignore-unreachable", action="store_true",
                   help="leave out hosts that cannot be reached over ssh instead of stopping")
    p.add_argument("--subnet", default=DEFAULT_SUBNET,
                   help=f"private block the per-cable /30 subnets are taken from (default {DEFAULT_SUBNET})")
    p.add_argument("--ssh-config", metavar="FILE", help="an ssh_config to use in addition to ~/.ssh/config")
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT, metavar="SECONDS",
                   help=f"per-host ssh connect deadline (default {DEFAULT_CONNECT_TIMEOUT:g})")
    p.add_argument("--command-timeout", type=float, default=DEFAULT_COMMAND_TIMEOUT, metavar="SECONDS",
                   help=f"per-host deadline for each remote command (default {DEFAULT_COMMAND_TIMEOUT:g})")
    p.add_argument("--verbose", action="store_true", help="say what is being done, on stderr")
    return p


@dataclass
class Context:
    args: argparse.Namespace

    def info(self, message: str) -> None:
        if self.args.verbose:
            print(f"[launcher-config] {message}", file=sys.stderr, flush=True)

    def warn(self, message: str) -> None:
        print(f"launcher-config: warning: {message}", file=sys.stderr, flush=True)


def read_hosts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(ssh targets, envs) from --hosts or --hostfile; a hostfile's envs come before --env."""
    for item in args.env:
        key, sep, _ = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
    if args.hostfile:
        source: Hostfile = load_hostfile(args.hostfile)
        envs = list(source.envs) + list(args.env)
    else:
        source = hosts_from_list(args.hosts)
        envs = list(args.env)
    targets = [h.ssh for h in source.hosts]
    duplicates = sorted({t for t in targets if targets.count(t) > 1})
    if duplicates:
        raise UsageError(f"host {duplicates[0]} is listed twice (one entry per machine)")
    return targets, envs


def check_access(ctx: Context, remote: RemoteHosts) -> list[HostAccess]:
    """Report ssh and sudo per host; stop on unreachable hosts unless told to drop them."""
    report = remote.check_access()
    for entry in report:
        if entry.reachable:
            sudo = "root" if entry.access.is_root else ("passwordless sudo" if entry.access.has_sudo else "no passwordless sudo")
            ctx.info(f"{entry.target}: reachable ({entry.access.system}, {sudo})")
        else:
            print(f"launcher-config: {entry.target}: unreachable: {entry.error}", file=sys.stderr)
    failed = [e.target for e in report if not e.reachable]
    if failed and not ctx.args.ignore_unreachable:
        raise UsageError(f"cannot reach {', '.join(failed)} over ssh (reasons above); "
                         "fix passwordless ssh or pass --ignore-unreachable")
    if failed:
        ctx.warn(f"leaving out unreachable hosts: {', '.join(failed)}")
    if not any(e.reachable for e in report):
        raise UsageError("no host is reachable over ssh")
    return report


def discover(ctx: Context, remote: RemoteHosts, report: list[HostAccess]) -> list[HostFacts]:
    ctx.info("asking every host about its network hardware")
    probes = [MACOS_PROBE if entry.access.system == "Darwin" else LINUX_PROBE for entry in report]
    outcomes = remote.run_each(lambda i: probes[i])
    failed = [f"{o.target} ({o.error})" for o in outcomes if not o.ok and not o.stdout]
    if failed:
        raise UsageError(f"discovery failed on {', '.join(failed)}")
    facts = [parse_probe(entry.target, entry.access, o.stdout) for entry, o in zip(report, outcomes)]
    for f in facts:
        ctx.info(f"{f.ssh}: ethernet address {f.ethernet_address or 'unknown'}, "
                 f"{len(f.thunderbolt)} Thunderbolt ports, RDMA: {', '.join(sorted(f.rdma_names())) or 'none'}")
    return facts


def lan_dot(facts: list[HostFacts]) -> str:
    lines = ["graph topology {", "  node [shape=box];", '  lan [label="LAN", shape=ellipse];']
    for i, f in enumerate(facts):
        lines.append(f'  h{i} [label="{f.ssh}"];')
        lines.append(f'  h{i} -- lan [label="{f.ethernet_address or "?"}"];')
    return "\n".join(lines + ["}"]) + "\n"


def configure_ethernet(ctx: Context, facts: list[HostFacts], envs: list[str]) -> tuple[Hostfile | None, str]:
    """Hosts on one switched LAN: every pair is connected through the switch; no link setup."""
    if ctx.args.dot:
        return None, lan_dot(facts)
    backend = ctx.args.backend
    if backend is None:
        backend = "jaccl" if all(lan_rdma_device(f) for f in facts) and len(facts) > 1 else "ring"
        ctx.info(f"chose backend {backend}")
    if ctx.args.auto_setup:
        ctx.info("--over ethernet needs no link setup: the hosts already share a LAN")
    return ethernet_hostfile(facts, backend, envs), ""


def rdma_gaps(topo: Topology, facts: list[HostFacts]) -> list[str]:
    return [f"{facts[h].ssh} {c.iface_of(h)}" for c in topo.cables for h in (c.a, c.b)
            if facts[h].rdma_for_iface(c.iface_of(h)) is None]


def choose_tb_backend(ctx: Context, topo: Topology, facts: list[HostFacts]) -> tuple[str, tuple[list[int], int] | None]:
    """(backend, ring) for the request; errors name the missing cables or RDMA devices."""
    wanted = ctx.args.backend
    mesh = is_full_mesh(topo)
    ring = find_ring(topo)
    gaps = rdma_gaps(topo, facts)
    if wanted is None:
        if mesh and not gaps and topo.size > 1:
            return "jaccl", ring
        if ring and not gaps and topo.size > 1:
            return "jaccl-ring", ring
        if ring:
            if gaps:
                ctx.info(f"RDMA missing on {', '.join(gaps)}: using the ring backend over TCP")
            return "ring", ring
        raise TopologyError(f"neither a full mesh nor a ring: {explain_no_ring(topo)}; "
                            f"{explain_no_mesh(topo)} (run with --dot to see the cables)")
    if wanted == "jaccl" and not mesh:
        raise TopologyError(f"jaccl needs a cable between every pair of hosts: {explain_no_mesh(topo)}")
    if wanted in ("ring", "jaccl-ring") and ring is None:
        raise TopologyError(f"{wanted}: {explain_no_ring(topo)} (run with --dot to see the cables)")
    if wanted in ("jaccl", "jaccl-ring") and gaps:
        raise TopologyError(f"{wanted} needs RDMA on every cable; missing on {', '.join(gaps)} "
                            "(enable it with `rdma_ctl enable` in recovery mode, or use --backend ring)")
    return wanted, ring


def configure_thunderbolt(ctx: Context, remote: RemoteHosts, report: list[HostAccess],
                          facts: list[HostFacts], envs: list[str]) -> tuple[Hostfile | None, str]:
    not_mac = [f.ssh for f in facts if not f.is_macos]
    if not_mac:
        raise UsageError(f"--over thunderbolt discovers cables on macOS hosts only; {', '.join(not_mac)} "
                         "run another system (use --over ethernet)")
    if len(facts) < 2:
        raise UsageError("--over thunderbolt needs at least two hosts (cables run between hosts)")
    topo = from_thunderbolt(facts)
    for warning in topo.warnings:
        ctx.warn(warning)
    ctx.info(f"found {len(topo.cables)} Thunderbolt cables between {topo.size} hosts")
    if ctx.args.dot:
        return None, to_dot(topo)
    backend, ring = choose_tb_backend(ctx, topo, facts)
    ctx.info(f"backend {backend}")

    plan = plan_addresses(topo, ctx.args.subnet)
    check_no_clash(plan, facts, ctx.args.subnet)
    commands = host_commands(plan, facts)
    use_sudo = [not entry.access.is_root for entry in report]
    printed = ""
    if ctx.args.auto_setup:
        no_sudo = [e.target for e in report if not e.can_sudo]
        if no_sudo:
            raise UsageError(f"--auto-setup needs passwordless sudo (`sudo -n true` failed) on {', '.join(no_sudo)}; "
                             "run without --auto-setup to get the commands to run by hand")
        ctx.info("configuring the links through sudo")
        failed = [f"{o.target}: {o.error}" for o in remote.apply(commands, use_sudo) if not o.ok]
        if failed:
            raise UsageError("link setup failed on " + "; ".join(failed))
    else:
        printed = format_commands(topo.hosts, commands, use_sudo)

    if backend == "jaccl":
        hostfile = jaccl_hostfile(topo, facts, mesh_connections(topo), envs)
    elif backend == "jaccl-ring":
        hostfile = jaccl_ring_hostfile(topo, facts, ring[0], ring[1], envs)
    else:
        hostfile = ring_hostfile(topo, plan, ring[0], ring[1], envs)
    return hostfile, printed


def write_result(ctx: Context, hostfile: Hostfile | None, printed: str) -> None:
    if printed:
        sys.stdout.write(printed + ("\n" if hostfile is not None else ""))
    if hostfile is None:
        return
    text = dumps_hostfile(hostfile)
    if ctx.args.output:
        try:
            with open(ctx.args.output, "w") as f:
                f.write(text)
        except OSError as exc:
            raise UsageError(f"--output {ctx.args.output}: {exc.strerror}") from None
        # Always said (not only with --verbose): otherwise a run with --output prints nothing at all.
        print(f"launcher-config: wrote the {hostfile.backend} hostfile for {len(hostfile.hosts)} hosts to "
              f"{ctx.args.output}", file=sys.stderr, flush=True)
    else:
        sys.stdout.write("Hostfile\n========\n" + text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    ctx = Context(args)
    targets, envs = read_hosts(args)
    ctx.info(f"checking ssh and sudo on {', '.join(targets)}")
    with RemoteHosts(targets, ssh_config=args.ssh_config, connect_timeout=args.connect_timeout,
                     command_timeout=args.command_timeout) as remote:
        report = check_access(ctx, remote)
        reachable = [e for e in report if e.reachable]
        if len(reachable) != len(report):
            remote.close()
            remote = RemoteHosts([e.target for e in reachable], ssh_config=args.ssh_config,
                                 connect_timeout=args.connect_timeout, command_timeout=args.command_timeout)
        with remote:
            facts = discover(ctx, remote, reachable)
            if args.over == "ethernet":
                hostfile, printed = configure_ethernet(ctx, facts, envs)
            else:
                hostfile, printed = configure_thunderbolt(ctx, remote, reachable, facts, envs)
    write_result(ctx, hostfile, printed)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (UsageError, HostfileError, TopologyError, PlanError, OutputError, SshError, ProbeError) as exc:
        print(f"launcher-config: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("launcher-config: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of ours: still one line, the traceback only on request
        if args.verbose:
            traceback.print_exc()
        print(f"launcher-config: error: internal error: {type(exc).__name__}: {exc}"
              + ("" if args.verbose else " (--verbose shows the traceback)"), file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
