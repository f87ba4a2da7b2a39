import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from slurm_cluster import SlurmCluster, missing  # noqa: E402


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running one-node Slurm; skipped with the reason when Slurm cannot run here."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
