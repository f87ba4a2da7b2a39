"""Transports shared by the backends: sockets and the handshake, the stream engine (ring), the
slot interface with its TCP mesh and RDMA verbs implementations (JACCL)."""
