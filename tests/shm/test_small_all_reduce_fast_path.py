"""The small-message fast paths: quiet_call / quiet_ufunc hide overflow and invalid results as
np.errstate does, and leave the caller's error state alone; ops' numpy fast path agrees with
numpy on 2 ranks over shared memory for every dtype and op, and still refuses what the general
path refuses."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from ranks import assert_all_ok, run

from adapter.backends.elements import quiet_call, quiet_ufunc


def test_quiet_call_hides_overflow_and_invalid_only_and_restores_the_callers_state():
    big = np.array([3e38, np.inf], np.float32)
    out = np.empty(2, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet_ufunc(np.add, big, big, out)
        quiet_call(np.subtract, big, big, out)  # inf - inf: invalid
    assert out[0] == 0 and np.isnan(out[1])
    with np.errstate(all="raise"):
        quiet_ufunc(np.multiply, big, big, out)
        quiet_call(np.add.reduce, np.stack([big, big]), 0, None, out)
        with pytest.raises(FloatingPointError):  # divide is not one of the quieted errors
            quiet_ufunc(np.divide, big, np.zeros(2, np.float32), out)
        assert np.geterr()["over"] == "raise" and np.geterr()["invalid"] == "raise"
        with pytest.raises(FloatingPointError):
            np.add(big, big)
    with pytest.raises(ValueError):  # an error inside the call still restores the state
        quiet_ufunc(np.add, big, np.ones(3, np.float32), out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning):
            np.add(big, big)


@pytest.mark.timeout(90)
def test_numpy_fast_path_every_dtype_and_op_and_bad_input_on_two_ranks():
    assert_all_ok(run(2, "shm/scripts/fast_path.py", timeout=80, env={"EXPECT_SHM": "1"}))
