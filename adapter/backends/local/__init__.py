"""Same-host shared memory for every backend: ranks placed by host (shm.form), one segment per
host whose steps, waits, liveness checks and collectives run in the native engine (segment.py
over csrc/shm, its failures worded in engine.py). Nothing here knows a backend: a backend passes
in how to gather placement records and how to describe its headers."""
