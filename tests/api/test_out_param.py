"""out= on the numpy API collectives (adapter/ops.py): 2 ranks of a local ring, real processes."""
import numpy as np
import pytest
import ranks

import adapter
from adapter import group as group_module


@pytest.mark.timeout(90)
def test_out_is_written_in_place_and_checked_on_two_ranks():
    results = ranks.collect(ranks.spawn(2, "ring_scripts/out_param.py", env={"JACKLRING_TIMEOUT": "30"}), timeout=80)
    for r in results:
        assert r.returncode == 0 and "OUT OK" in r.stdout, f"rank {r.rank} exit {r.returncode}\n{r.stdout}\n{r.stderr}"


def test_out_in_a_group_of_one_is_a_copy_into_out(monkeypatch):
    for name in ("MLX_RANK", "MLX_HOSTFILE", "OMPI_COMM_WORLD_SIZE", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    group_module._reset_for_tests()
    try:
        x = np.arange(4, dtype=np.int32)
        out = np.zeros_like(x)
        assert adapter.all_sum(x, out=out) is out and np.array_equal(out, x)
        assert adapter.all_gather(x, out=out) is out and np.array_equal(out, x)
        assert adapter.broadcast(x, out=x) is x
        with pytest.raises(ValueError, match="out= must be a writable C-contiguous array of shape"):
            adapter.sum_scatter(x, out=np.zeros(3, np.int32))
    finally:
        group_module._reset_for_tests()
