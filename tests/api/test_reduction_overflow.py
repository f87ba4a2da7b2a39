"""The reduction kernels (adapter/backends/elements.py) on IEEE edge cases."""
import warnings

import numpy as np

from adapter.backends.base import ReduceOp
from adapter.backends.elements import BFLOAT16, reduce_into, reduce_many


def test_float_overflow_to_inf_is_silent():
    # IEEE overflow to inf is the right answer, not a reason to print numpy warnings from the library.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dt in (np.float16, BFLOAT16, np.float32):
            big = np.full(3, 6e4 if dt == np.float16 else 3e38, dt)
            out = np.empty_like(big)
            reduce_into(out, big, big, ReduceOp.SUM)
            assert np.isinf(out.astype(np.float32)).all()
            reduce_many(out, [big, big, big], ReduceOp.SUM)
            assert np.isinf(out.astype(np.float32)).all()
        inf = np.array([np.inf], np.float64)
        reduce_into(inf.copy(), inf, -inf, ReduceOp.SUM)  # inf - inf = nan, silently
