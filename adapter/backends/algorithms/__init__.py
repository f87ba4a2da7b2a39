"""Collective schedules written once against PeerExchange (peers.py): recursive doubling and
halving, Rabenseifner, binomial tree, dissemination (schedules.py), and the table that chooses
among them and each backend's own schedule by operation, message size and group size
(selection.py). The ring backend (ring/peer_exchange.py) and JACCL's mesh
(jaccl/peer_exchange.py) implement the interface."""
