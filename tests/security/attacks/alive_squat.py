"""Hold the abstract Unix names of the given ring addresses (before their ranks bind them) and
answer every liveness probe there as a live rank would: the handshake's CHALLENGE with status
ALIVE. A prober that does not check who answers then calls a dead rank alive.

    alive_squat.py ADDRESS [ADDRESS ...]      (ADDRESS: ip:port)

Prints READY once every name is held, and a line PROBED per answered probe."""
import socket
import sys
import threading

HELLO_BYTES = 60
ALIVE_ANSWER = b"JKLC" + bytes([4]) + bytes(32)   # handshake.CHALLENGE, status ALIVE


def serve(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        try:
            conn.settimeout(2)
            data = b""
            while len(data) < HELLO_BYTES:
                chunk = conn.recv(HELLO_BYTES - len(data))
                if not chunk:
                    break
                data += chunk
            conn.sendall(ALIVE_ANSWER)
            print("PROBED", flush=True)
        except OSError:
            pass
        conn.close()


threads = []
for address in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\0jacklring-" + address)
    s.listen(16)
    t = threading.Thread(target=serve, args=(s,), daemon=True)
    t.start()
    threads.append(t)
print("READY", flush=True)
threads[0].join()
