"""The remote side of a rank: a watchdog that runs the rank and dies with its connection.

The launcher runs `python -c <bootstrap>` over ssh and writes this file's source and the spec
to its stdin (standard library only, nothing installed remotely; nothing but the bootstrap on
the command line, where every user could read the rank's environment and the job secret).
It then:

- writes the spec's files (MLX_HOSTFILE, MLX_IBV_DEVICES contents) to a temp dir on *this*
  host and points their variables at them, applies the environment and working directory;
- starts the rank in its own session (so the whole tree can be signalled at once);
- reads framed messages from stdin: DATA (forwarded to the rank's stdin), EOF (close the
  rank's stdin) and SIGNAL (signal the rank's process group);
- when its own stdin reaches a real end (the launcher or the ssh connection went away) it
  stops the rank: SIGTERM, then SIGKILL after a grace period. No orphans stay behind.

Exit status: the rank's exit code, or 128 + signal number.
"""

import base64
import ctypes
import json
import os
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading

FRAME_HEADER = struct.Struct(">cI")  # kind, payload length
DATA, EOF, SIGNAL = b"D", b"E", b"K"


def encode_frame(kind: bytes, payload: bytes = b"") -> bytes:
    return FRAME_HEADER.pack(kind, len(payload)) + payload


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the agent dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Agent:
    def __init__(self, spec):
        self.spec = spec
        self.grace = float(spec.get("grace", 3.0))
        self.child = None
        self.stopping = threading.Event()
        self.stdin_queue = queue.Queue()

    def signal_group(self, sig):
        try:
            os.killpg(self.child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, sig=signal.SIGTERM):
        """Signal the rank's group, then SIGKILL it if it outlives the grace period."""
        self.signal_group(sig)
        if not self.stopping.is_set():
            self.stopping.set()
            timer = threading.Timer(self.grace, self.signal_group, (signal.SIGKILL,))
            timer.daemon = True
            timer.start()

    def read_frames(self):
        """Frames from the launcher; a real EOF means the launcher is gone."""
        stream = sys.stdin.buffer
        while True:
            header = stream.read(FRAME_HEADER.size)
            if len(header) < FRAME_HEADER.size:
                break
            kind, size = FRAME_HEADER.unpack(header)
            payload = stream.read(size) if size else b""
            if len(payload) < size:
                break
            if kind == DATA:
                self.stdin_queue.put(payload)
            elif kind == EOF:
                self.stdin_queue.put(None)
            elif kind == SIGNAL:
                self.stop(payload[0])
        self.stdin_queue.put(None)
        self.stop(signal.SIGTERM)

    def feed_stdin(self):
        # A separate thread, so a rank that never reads stdin cannot block the frame reader.
        pipe = self.child.stdin
        while True:
            data = self.stdin_queue.get()
            try:
                if data is None:
                    pipe.close()
                    return
                pipe.write(data)
                pipe.flush()
            except (BrokenPipeError, OSError, ValueError):
                return

    def run(self):
        spec = self.spec
        env = dict(os.environ)
        env.update(spec["env"])
        tmpdir = tempfile.mkdtemp(prefix="launcher-rank-") if spec["files"] else None
        for name, content in spec["files"].items():
            path = os.path.join(tmpdir, name.lower() + ".json")
            with open(path, "w") as f:
                f.write(content)
            env[name] = path

        cwd = spec.get("cwd")
        if cwd and not os.path.isdir(cwd):
            if spec.get("cwd_required"):
                sys.stderr.write(f"launcher: working directory {cwd} does not exist on this host\n")
                return 2
            cwd = None  # like mlx.launch: the launcher's own cwd is only a best effort

        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop(signum))
        try:
            self.child = subprocess.Popen(
                spec["argv"], env=env, cwd=cwd, stdin=subprocess.PIPE,
                # one stream when the launcher shows both in one file: the rank's order holds
                stderr=subprocess.STDOUT if spec.get("merge_stderr") else None,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        except OSError as e:
            sys.stderr.write(f"launcher: cannot run {spec['argv'][0]}: {e.strerror}\n")
            return 127
        threading.Thread(target=self.read_frames, daemon=True).start()
        threading.Thread(target=self.feed_stdin, daemon=True).start()
        while True:
            try:
                code = self.child.wait()
                break
            except InterruptedError:
                continue
        self.signal_group(signal.SIGKILL)  # whatever the rank left running in its group
        if code < 0 and not self.stopping.is_set():
            # Only the 128 + N code crosses ssh: say here which signal it was.
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            sys.stderr.write(f"launcher: rank process {self.child.pid} was killed by {name}\n")
        if tmpdir:
            for name in os.listdir(tmpdir):
                os.unlink(os.path.join(tmpdir, name))
            os.rmdir(tmpdir)
        return code if code >= 0 else 128 - code


def read_spec(stream):
    """The spec after the source on stdin: a decimal length line, then that much JSON."""
    size = int(stream.readline())
    if not 0 <= size <= 1 << 26:
        raise ValueError(f"agent spec of {size} bytes")
    return json.loads(stream.read(size))


def main(argv):
    spec = json.loads(base64.b64decode(argv[1])) if len(argv) > 1 else read_spec(sys.stdin.buffer)
    code = Agent(spec).run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv)
