"""Listen on a rank's TCP port before the job does. argv: address mode (banner|silent).
banner: answer every connection with an HTTP error; silent: accept and say nothing."""
import socket
import sys
import threading
import time

address, mode = sys.argv[1], sys.argv[2]
host, _, port = address.rpartition(":")
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind((host, int(port)))
listener.listen(16)
print("READY", flush=True)
held = []


def answer(conn):
    try:
        conn.recv(100)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    except OSError:
        pass


end = time.monotonic() + 40
listener.settimeout(0.5)
while time.monotonic() < end:
    try:
        conn, _ = listener.accept()
    except socket.timeout:
        continue
    held.append(conn)
    if mode == "banner":
        threading.Thread(target=answer, args=(conn,), daemon=True).start()
