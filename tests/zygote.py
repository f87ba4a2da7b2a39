"""A fork server for the rank processes of the torch tests and the fault tests: one process per pytest worker that
has imported torch, torch.distributed, torch._dynamo, numpy and pytest once, and forks a child for each rank instead
of the test starting a fresh interpreter that imports them again (most of a small rank's CPU).

Test side: popen(args, ...) returns an object with the subprocess.Popen subset the harnesses use
(pid, args, returncode, poll, wait, communicate, kill, terminate, send_signal, stdout/stderr
pipes) when args is `[sys.executable, SCRIPT, *ARGS]`, else (another command, or no zygote) a
subprocess.Popen. The zygote starts on first use and stops at the end of the session (or when
the worker that started it goes away: it reads its stdin to EOF); it never imports the
repository's modules, which read the environment at import.

Child side: the environment is replaced wholesale by the request's, then cwd, sys.argv,
sys.path (the script's folder, the request's PYTHONPATH entries, the zygote's own site paths),
stdin/stdout/stderr (file descriptors passed over the Unix socket), and the script runs as
__main__; it ends as an interpreter does (SystemExit's code, an uncaught exception's traceback
and exit 1, non-daemon threads joined, atexit handlers, streams flushed). The zygote reports
each child's exit status (a negative signal number when killed, like Popen.returncode).

What differs from a fresh interpreter: the ranks share the zygote's str hash seed and its
interpreter flags, modules torch imports are already imported, and torch's "torch.backends"
entry points (this repository's torch backend) load before the script runs, not at its
`import torch` (the zygote does not load them: the installed copy of the repository need not
be the one on the request's PYTHONPATH). Tests whose point is a
fresh interpreter (import side effects, threads or environment at import, the launcher,
ranks started by torchrun / mpirun / srun) must keep subprocess.Popen.
"""
from __future__ import annotations

import io
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

PIPE = subprocess.PIPE
STDOUT = subprocess.STDOUT
DEVNULL = subprocess.DEVNULL


# ------------------------------------------------------------------ server (the zygote process)

def _serve(path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    # `import torch` loads the "torch.backends" entry points, this repository's torch backend
    # among them, from the installed copy, which need not be the tree under test (a worktree on
    # PYTHONPATH): each child loads them instead, from its own sys.path.
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    import numpy  # noqa: F401
    import pytest  # noqa: F401  (the test files that are their own rank script import it)
    import torch  # noqa: F401

    # Not imported by torch itself, but by the first optimizer step or DDP wrap, ~2 CPU-s each time
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    assert threading.active_count() == 1, "importing torch started threads: forking would lose them"
    del os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("adapter", "launcher", "jacklring_shared"))
    assert not loaded, f"the zygote imported the repository's modules {loaded[:5]}: its children would share them"

    site_path = [p for p in sys.path[1:]]  # without this file's folder
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}

    def reap() -> None:
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = children.pop(pid, None)
            if conn is None:
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            own = os.times()
            reply = {"exit": code, "cpu": usage.ru_utime + usage.ru_stime, "zygote_cpu": own.user + own.system}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass
            conn.close()

    while True:
        for key, _ in selector.select():
            if key.data == "child":
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                reap()
            elif key.data == "parent":
                if not os.read(sys.stdin.fileno(), 512):  # the worker closed its end, or died
                    for pid in list(children):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    while children:
                        pid, _ = os.wait()
                        children.pop(pid, None)
                    os._exit(0)
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, site_path, [listener, conn, *children.values()], [wake_r, wake_w])
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:
                    pass
        reap()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("short request")
        data += more
    if len(fds) != 3:
        raise ValueError("a request carries stdin, stdout and stderr")
    return json.loads(data[4:]), fds


def _child(request: dict, fds: list[int], site_path: list[str], sockets: list, fds_to_close: list[int]) -> None:
    """In the forked child: become the interpreter the request asked for, run it, never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in sockets:
            s.close()
        for fd in fds_to_close:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[:] = ([os.path.dirname(os.path.abspath(script))]
                       + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + site_path)
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        encoding = (env.get("PYTHONIOENCODING") or "utf-8").split(":")[0] or "utf-8"
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding)
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            open(1, "wb", buffering=0 if unbuffered else -1, closefd=False), encoding=encoding,
            line_buffering=not unbuffered and os.isatty(1), write_through=unbuffered)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            open(2, "wb", buffering=0 if unbuffered else -1, closefd=False), encoding=encoding,
            errors="backslashreplace", line_buffering=True, write_through=unbuffered)
        import faulthandler
        if env.get("PYTHONFAULTHANDLER"):
            faulthandler.enable(file=sys.stderr, all_threads=True)
        elif faulthandler.is_enabled():
            faulthandler.disable()
        import numpy.random
        numpy.random.seed()  # a fresh interpreter draws numpy's global seed from the OS
        import torch
        if torch._is_device_backend_autoload_enabled():  # what `import torch` does, from this sys.path
            torch._import_device_backends()
        code = _run(script)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _run(script: str) -> int:
    import atexit
    import runpy
    import traceback
    code: Any = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code == -signal.SIGINT:  # as an interpreter ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


# ------------------------------------------------------------------ client (the test side)

class _Zygote:
    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="zygote-")  # 0700: no other uid can connect
        self.path = os.path.join(self.directory, "socket")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", self.path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=self.directory)
        line = self.proc.stdout.readline()
        if line != b"READY\n":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("the zygote did not start")
        self.proc.stdout.close()

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self.directory)
        except OSError:
            pass


_zygote: _Zygote | None = None
_failed = False
_lock = threading.Lock()
CPU = {"children": 0.0, "zygote": 0.0}  # CPU-s of the reaped children and of the zygote itself


def _get() -> _Zygote | None:
    global _zygote, _failed
    with _lock:
        if _zygote is None and not _failed and not os.environ.get("TESTS_NO_ZYGOTE"):
            try:
                _zygote = _Zygote()
            except Exception as e:
                _failed = True
                print(f"[zygote] not started ({e}): rank processes start as fresh interpreters", file=sys.stderr)
        return _zygote


def stop() -> None:
    """End the zygote (if this process started one); its children still running are killed."""
    global _zygote
    with _lock:
        if _zygote is not None:
            _zygote.stop()
            _zygote = None


class Process:
    """A forked rank: the subprocess.Popen subset the test harnesses use."""

    def __init__(self, zygote: _Zygote, args: list[str], env: dict[str, str], cwd: str,
                 stdin: Any, stdout: Any, stderr: Any, text: bool) -> None:
        self.args = args
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        self._text = text
        self._chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self._lock = threading.Lock()
        mine, theirs = [], []
        try:
            for name, spec in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
                if spec == PIPE:
                    r, w = os.pipe()
                    ours, child = (w, r) if name == "stdin" else (r, w)
                    mine.append((name, ours))
                    theirs.append(child)
                elif spec == STDOUT and name == "stderr":
                    theirs.append(os.dup(theirs[1]))
                elif spec == DEVNULL:
                    theirs.append(os.open(os.devnull, os.O_RDWR))
                elif spec is None:
                    theirs.append(os.dup(("stdin", "stdout", "stderr").index(name)))
                elif isinstance(spec, int):
                    theirs.append(os.dup(spec))
                else:
                    theirs.append(os.dup(spec.fileno()))
            body = json.dumps({"argv": args[1:], "env": env, "cwd": cwd}).encode()
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._conn.connect(zygote.path)
            data = struct.pack("!I", len(body)) + body
            sent = socket.send_fds(self._conn, [data], theirs)
            if sent < len(data):
                self._conn.sendall(data[sent:])
            self._buffer = b""
            self.pid = self._message(None)["pid"]
        except BaseException:
            for _, fd in mine:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        for name, fd in mine:
            mode = "w" if name == "stdin" else "r"
            setattr(self, name, open(fd, mode) if text else open(fd, mode + "b"))

    def _message(self, timeout: float | None) -> dict | None:
        """The next line from the zygote, or None when none came within timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                more = self._conn.recv(4096)
            except (socket.timeout, BlockingIOError):
                return None
            if not more:
                raise RuntimeError(f"the zygote ended before child {getattr(self, 'pid', '?')} did")
            self._buffer += more
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _wait(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                message = self._message(timeout)
                if message is not None:
                    self.returncode = message["exit"]
                    CPU["children"] += message["cpu"]
                    CPU["zygote"] = max(CPU["zygote"], message["zygote_cpu"])
                    self._conn.close()
            return self.returncode

    def __del__(self) -> None:
        # A test may drop a rank it killed without waiting for it, as it may a Popen: the zygote
        # reaps the child either way, so the connection that would carry its exit status closes
        # here instead of warning (as an unclosed socket) in whichever test the collector runs.
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """As Popen.communicate: output read before a TimeoutExpired is kept for the next call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None and not self.stdin.closed:
            if input:
                threading.Thread(target=self._feed, args=(self.stdin, input), daemon=True).start()
            else:
                self.stdin.close()
        streams = {s.fileno(): name for name, s in (("stdout", self.stdout), ("stderr", self.stderr))
                   if s is not None and not s.closed}
        with selectors.DefaultSelector() as selector:
            for fd in streams:
                selector.register(fd, selectors.EVENT_READ)
            while streams:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        self._chunks[streams[key.fd]].append(data)
                    else:
                        selector.unregister(key.fd)
                        getattr(self, streams.pop(key.fd)).close()
        if self.wait(None if deadline is None else max(0.0, deadline - time.monotonic())) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._output("stdout"), self._output("stderr")

    @staticmethod
    def _feed(stream: Any, data: Any) -> None:
        try:
            stream.write(data)
            stream.close()
        except (BrokenPipeError, OSError):
            pass

    def _output(self, name: str) -> Any:
        if getattr(self, name) is None and not self._chunks[name]:
            return None
        data = b"".join(self._chunks[name])
        if not self._text:
            return data
        return data.decode(errors="strict").replace("\r\n", "\n").replace("\r", "\n")


def popen(args: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None, stdin: Any = None,
          stdout: Any = None, stderr: Any = None, text: bool = False) -> Process | subprocess.Popen:
    """A rank process: forked by the zygote when args is `[sys.executable, SCRIPT, *ARGS]`,
    otherwise (or when no zygote could start) subprocess.Popen(args, ...)."""
    args = [os.fspath(a) for a in args]
    cwd = None if cwd is None else os.fspath(cwd)
    plain = len(args) >= 2 and args[0] == sys.executable and not args[1].startswith("-")
    zygote = _get() if plain else None
    if zygote is not None:
        try:
            return Process(zygote, args, dict(os.environ if env is None else env), cwd or os.getcwd(),
                           stdin, stdout, stderr, text)
        except (OSError, RuntimeError, KeyError) as e:
            print(f"[zygote] fork failed ({e}): a fresh interpreter instead", file=sys.stderr)
    return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve(sys.argv[2])
