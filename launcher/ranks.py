"""Running one rank: here as a subprocess, or on another host through Fabric.

Both kinds report to one queue: ("output", rank, fd, bytes), ("exit", index, code, signum)
as soon as the process has ended (code = exit status or 128 + signal number), whether or
not its output has been delivered yet (the launcher's reader may be stalled), and
("drained", index) once all of its output is.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from . import agent
from .agent import DATA, EOF, SIGNAL, encode_frame

CONNECT_TIMEOUT = 20.0
OUTPUT_DRAIN_TIMEOUT = 2.0  # after exit, how long a grandchild holding the pipe may delay us


class StartError(RuntimeError):
    """A rank could not be started (ssh failure, missing program, ...)."""


def exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


class RankProcess:
    """Shared bookkeeping: which rank, where, how to describe it in one line."""

    def __init__(self, index: int, rank: int, host_label: str) -> None:
        self.index = index
        self.rank = rank
        self.host_label = host_label
        self.events = None  # the supervisor's EventSink (anything with put(event))
        self.stdin_queue: queue.Queue = queue.Queue()
        self.delivered = 0   # output chunks handed over so far
        self.delivering = 0  # readers waiting for room in the output backlog
        self.count_lock = threading.Lock()

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host_label})"

    def _pump(self, read: Callable[[], bytes], fd: int) -> None:
        while True:
            try:
                data = read()
            except (OSError, ValueError, EOFError):
                return
            if not data:
                return
            self._deliver(("output", self.rank, fd, data))

    def _deliver(self, event: tuple) -> None:
        with self.count_lock:
            self.delivering += 1
        try:
            self.events.put(event)
        finally:
            with self.count_lock:
                self.delivering -= 1
                self.delivered += 1

    def _join_readers(self, readers: list[threading.Thread], idle_limit: float) -> None:
        """Wait for the readers to reach end of output. Give up only after idle_limit s
        without progress (a stray process outside the rank's group holding the pipe), not
        while they wait for a slow terminal to take what they read."""
        seen, idle_since = -1, time.monotonic()
        while any(t.is_alive() for t in readers):
            for t in readers:
                t.join(0.05)
            now = time.monotonic()
            if self.delivering or self.delivered != seen:
                seen, idle_since = self.delivered, now
            elif now - idle_since > idle_limit:
                return

    def _start_thread(self, target, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        return t

    # interface
    def start(self, events: queue.Queue) -> None: ...
    def send_stdin(self, data: bytes) -> None: self.stdin_queue.put(data)
    def close_stdin(self) -> None: self.stdin_queue.put(None)
    def signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...
    def cleanup(self) -> None: ...


class TempDirReaper:
    """Removes the ranks' temporary directories however the launcher ends, kill -9 included:
    a small process in a session of its own reads their paths from a pipe whose other end
    only the launcher holds, and removes them when the pipe closes (the launcher's exit, which
    the kernel closes it at; the ranks die with the launcher through PDEATHSIG)."""

    CODE = ("import shutil,sys\n"
            "paths=[line.rstrip('\\n') for line in sys.stdin]\n"
            "for path in paths: shutil.rmtree(path,ignore_errors=True)\n")

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()

    def register(self, path: str) -> None:
        with self.lock:
            try:
                if self.proc is None:
                    # -I -S: the standard library is all it needs; no site-packages, .pth files
                    # or PYTHON* variables to read (about 20 ms of CPU per launch).
                    self.proc = subprocess.Popen(
                        [sys.executable, "-I", "-S", "-c", self.CODE], stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        start_new_session=True, text=True)
                self.proc.stdin.write(path + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass  # best effort: cleanup() still removes the directories on a normal end


_reaper = TempDirReaper()


class LocalRank(RankProcess):
    """A subprocess in its own session, so the rank and its children die together."""

    def __init__(self, index: int, rank: int, argv: list[str], env: dict[str, str],
                 files: dict[str, str], cwd: Optional[str], merge_stderr: bool = False) -> None:
        super().__init__(index, rank, "127.0.0.1")
        self.argv, self.env, self.files, self.cwd = argv, env, files, cwd
        # When our stdout and stderr are one file, the rank writes both into one pipe: two
        # pipes read by two threads cannot tell which of two lines the rank wrote first.
        self.merge_stderr = merge_stderr
        self.proc: Optional[subprocess.Popen] = None
        self.tmpdir: Optional[str] = None

    def start(self, events: queue.Queue) -> None:
        # Must run on the main thread: PDEATHSIG fires when the *thread* that forked exits.
        self.events = events
        env = dict(os.environ)
        env.update(self.env)
        if self.files:
            self.tmpdir = tempfile.mkdtemp(prefix=f"launcher-rank{self.rank}-")
            _reaper.register(self.tmpdir)
            for name, content in self.files.items():
                path = Path(self.tmpdir) / f"{name.lower()}.json"
                path.write_text(content)
                env[name] = str(path)
        try:
            self.proc = subprocess.Popen(
                self.argv, env=env, cwd=self.cwd, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT if self.merge_stderr else subprocess.PIPE,
                start_new_session=True, preexec_fn=agent.die_with_parent,
            )
        except OSError as e:
            raise StartError(f"cannot run {self.argv[0]!r}: {e.strerror}") from None
        readers = [self._start_thread(self._pump, lambda: os.read(self.proc.stdout.fileno(), 65536), 1)]
        if not self.merge_stderr:
            readers.append(self._start_thread(self._pump, lambda: os.read(self.proc.stderr.fileno(), 65536), 2))
        self._start_thread(self._feed_stdin)
        self._start_thread(self._wait, readers)

    def _wait(self, readers) -> None:
        code = self.proc.wait()
        self.kill()  # the rank's leftovers (same process group) end with it, as remotely
        self.events.put(("exit", self.index, exit_code(code), -code if code < 0 else None))
        self._join_readers(readers, OUTPUT_DRAIN_TIMEOUT)
        self.events.put(("drained", self.index))

    def _feed_stdin(self) -> None:
        pipe = self.proc.stdin
        while True:
            data = self.stdin_queue.get()
            try:
                if data is None:
                    pipe.close()
                    return
                pipe.write(data)
                pipe.flush()
            except (OSError, ValueError):
                return

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def cleanup(self) -> None:
        self.kill()  # leftovers in the rank's process group
        if self.tmpdir:
            for p in Path(self.tmpdir).iterdir():
                p.unlink()
            os.rmdir(self.tmpdir)
            self.tmpdir = None


class RemoteRank(RankProcess):
    """A rank on another host: one ssh session running launcher/agent.py as a watchdog.

    The agent writes the temp files on the remote host, applies env and cwd, and kills
    the rank's process group when told to or when the ssh session ends."""

    def __init__(self, index: int, rank: int, connection, agent_python: str,
                 argv: list[str], env: dict[str, str], files: dict[str, str],
                 cwd: Optional[str], cwd_required: bool, grace: float,
                 host_label: Optional[str] = None, merge_stderr: bool = False) -> None:
        super().__init__(index, rank, host_label or connection.original_host)
        self.connection = connection
        self.agent_python = agent_python
        self.spec = {"argv": argv, "env": env, "files": files, "cwd": cwd,
                     "cwd_required": cwd_required, "grace": grace, "merge_stderr": merge_stderr}
        self.channel = None
        self.send_lock = threading.Lock()

    def remote_command(self) -> str:
        """The ssh command line: a bootstrap that reads the agent and its spec from stdin
        (remote_preamble). The spec holds the rank's environment, the job secret among it: on a
        command line every user of the remote host could read it with ps."""
        bootstrap = ("import sys;n=int(sys.stdin.buffer.readline());"
                     "exec(compile(sys.stdin.buffer.read(n),'launcher-agent','exec'))")
        return "exec " + shlex.join([self.agent_python, "-c", bootstrap])

    def remote_preamble(self) -> bytes:
        """What the agent reads first from stdin: its source, then its spec, each as a decimal
        length line and the bytes (then come the framed messages)."""
        source = Path(agent.__file__).read_bytes()
        spec = json.dumps(self.spec).encode()
        return b"%d\n%s%d\n%s" % (len(source), source, len(spec), spec)

    def start(self, events: queue.Queue) -> None:
        self.events = events
        try:
            self.channel = self.connection.create_session()
            self.channel.exec_command(self.remote_command())
            self.channel.sendall(self.remote_preamble())
        except Exception as e:  # paramiko raises several unrelated types
            raise StartError(f"ssh session to {self.host_label} failed: {e}") from None
        readers = [
            self._start_thread(self._pump, lambda: self.channel.recv(65536), 1),
            self._start_thread(self._pump, lambda: self.channel.recv_stderr(65536), 2),
        ]
        self._start_thread(self._feed_stdin)
        self._start_thread(self._wait, readers)

    def _wait(self, readers) -> None:
        # sshd sends the status after the output, so this still waits for a stalled reader
        status = self.channel.recv_exit_status()  # -1: session closed without a status
        self.events.put(("exit", self.index, status if status >= 0 else 255, None))
        for t in readers:
            t.join()
        self.events.put(("drained", self.index))

    def _send(self, frame: bytes) -> None:
        with self.send_lock:
            try:
                self.channel.sendall(frame)
            except Exception:
                pass  # session gone: the agent is stopping the rank on its own

    def _feed_stdin(self) -> None:
        while True:
            data = self.stdin_queue.get()
            if data is None:
                self._send(encode_frame(EOF))
                return
            self._send(encode_frame(DATA, data))

    def signal(self, sig: int) -> None:
        if self.channel is not None:
            # Not through the stdin queue: a stop must not wait behind user input.
            threading.Thread(target=self._send, args=(encode_frame(SIGNAL, bytes([sig])),),
                             daemon=True).start()

    def kill(self) -> None:
        if self.channel is not None:
            self.channel.close()  # the agent sees EOF and SIGKILLs after its grace period

    def cleanup(self) -> None:
        if self.channel is not None:
            self.channel.close()


def remote_free_port(connection, python: str, address: str, timeout: float = CONNECT_TIMEOUT) -> Optional[int]:
    """A TCP port that is free on `address` of the connection's host, chosen there the way
    local ports are (bind to port 0); None when the host cannot tell."""
    family = "socket.AF_INET6" if ":" in address else "socket.AF_INET"
    code = (f"import socket;s=socket.socket({family});s.bind(({address!r},0));"
            "print(s.getsockname()[1])")
    try:
        # in_stream=False: invoke would otherwise forward (and eat) the launcher's own stdin
        result = connection.run(shlex.join([python, "-c", code]), hide=True, warn=True, timeout=timeout,
                                in_stream=False)
        port = int(result.stdout.strip().splitlines()[-1])
    except Exception:  # paramiko/invoke raise many types; the caller keeps its default
        return None
    return port if 0 < port < 65536 else None


def open_connections(targets: list[str], ssh_config: Optional[str],
                     timeout: float = CONNECT_TIMEOUT) -> dict:
    """One Fabric Connection per distinct target, opened in parallel.

    Returns {target: Connection or StartError}; StartError (one line naming the extra to
    install) when Fabric is missing."""
    try:
        import fabric  # lazy: local runs need no ssh stack
        import paramiko
    except ImportError as e:
        raise StartError(f"{', '.join(targets)} {'is' if len(targets) == 1 else 'are'} remote, and launching "
                         f"over ssh needs Fabric, which is not installed ({e}): "
                         "pip install 'jacklring[launch]'") from None
    # paramiko logs a failed handshake with two tracebacks through the logging module's
    # last-resort handler; the StartError below says it in one line (a program that set up
    # logging still gets paramiko's records through its own handlers).
    logging.getLogger("paramiko").addHandler(logging.NullHandler())

    def new_config() -> "fabric.Config":
        return fabric.Config(runtime_ssh_path=ssh_config) if ssh_config else fabric.Config()

    # One Config per connection, built here: a Connection keeps the Config it is given (no
    # copy) and invoke rebuilds a Config's data in place while it merges, so threads sharing
    # one can see it half-built ("No attribute or config key found for 'gateway'").
    configs = {target: new_config() for target in targets}
    result: dict = {}

    def connect(target: str) -> None:
        try:
            conn = fabric.Connection(target, config=configs[target], connect_timeout=timeout)
            conn.open()
            conn.transport.set_keepalive(5)  # notice a dead peer instead of waiting forever
            result[target] = conn
        except paramiko.SSHException as e:  # the server answered, but not as an ssh server would
            result[target] = StartError(f"cannot ssh to {target}: the ssh handshake failed: {e}")
        except Exception as e:
            result[target] = StartError(f"cannot ssh to {target}: {e}")

    threads = [threading.Thread(target=connect, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    for t in targets:
        result.setdefault(t, StartError(f"cannot ssh to {t}: timed out after {timeout:.0f} s"))
    return result
