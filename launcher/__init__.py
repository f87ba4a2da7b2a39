"""The `launcher` command: start one process per rank, locally or over ssh (Fabric)."""
