"""A listener that accepts and closes every connection (in Python, as a rank's acceptor would):
the control target of a connection churn, so a flood at a rank can be compared with the same
churn elsewhere. Prints READY <port>."""
import socket

s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(512)
print("READY", s.getsockname()[1], flush=True)
while True:
    conn, _ = s.accept()
    conn.close()
