"""Same-host shared memory for every backend: ranks placed by host (shm.form), one segment per
host with step counters, waits and liveness (shm.SharedGroup), the atomics it rests on
(atomic_words), and the collectives that run over it (algorithms). Nothing here knows a
backend: a backend passes in how to gather placement records and how to describe its headers."""
