"""A remote launch that cannot start ends in one line on stderr, no traceback: without Fabric
(the `launch` extra) it names what to install; when the ssh handshake fails (a server that is
not an ssh server) it says so, without paramiko's two logged tracebacks."""
import json
import socket
import subprocess
import sys
import threading

import pytest
from conftest import base_env


def _launch(hostfile, *prelude: str) -> subprocess.CompletedProcess:
    code = "; ".join([*prelude, "from launcher.cli import main",
                      f"main(['--hostfile', {str(hostfile)!r}, '--', 'true'])"])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=base_env())


def _hostfile(tmp_path, port: int):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": f"127.0.0.1:{port}", "ips": ["127.0.0.1"]}]))
    return path


@pytest.mark.timeout(90)
def test_a_remote_launch_without_fabric_says_what_to_install(tmp_path):
    # None in sys.modules makes `import fabric` raise ModuleNotFoundError, as without the extra
    r = _launch(_hostfile(tmp_path, 2222), "import sys", "sys.modules['fabric'] = None")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert "launching over ssh needs Fabric" in r.stderr and "pip install 'jacklring[launch]'" in r.stderr


@pytest.mark.timeout(90)
def test_a_failed_ssh_handshake_is_one_line(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer_like_a_web_server():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
    thread = threading.Thread(target=answer_like_a_web_server, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    try:
        r = _launch(_hostfile(tmp_path, port))
    finally:
        stop.set()
        thread.join(5)
        server.close()
    assert r.returncode == 255, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"launcher: cannot ssh to 127.0.0.1:{port}:"), r.stderr
    assert "ssh handshake failed" in lines[0], r.stderr
