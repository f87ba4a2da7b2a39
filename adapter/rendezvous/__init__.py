"""Forming groups through what an engine already provides: a store ring (store_ring), its
authenticated records (store_records) and the secret it derives where none is set (store_secret).
Used by adapter.engines (torchrun, Slurm, a torch group) and by the torch process group alike."""
