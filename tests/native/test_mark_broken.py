"""A member's "left after an error" word (csrc/shm/step.c, jl_mark_broken) keeps the first blame
that names a rank: a member that saw rank 2 die and then gave the group up (break_links marks the
word again, naming nobody) must still tell a peer that arrives only now that rank 2 is to blame,
not itself."""
from __future__ import annotations

import numpy as np
import pytest
from engine_segments import attach

from adapter.backends.base import ReduceOp
from adapter.errors import PeerError, failure_of


@pytest.mark.timeout(30)
def test_a_later_mark_naming_nobody_keeps_the_rank_named_first():
    groups = attach(3)
    try:
        groups[0].mark_broken(2)   # member 0 saw rank 2 die mid-collective
        groups[0].mark_broken(-1)  # then its group was given up, which names nobody
        x = np.ones(4, np.float32)
        with pytest.raises(PeerError) as info:
            groups[1].all_reduce(None, x, x, ReduceOp.SUM)  # member 1 arrives only now
        assert failure_of(info.value).culprit == 2, str(info.value)
        assert "rank 2" in str(info.value), str(info.value)
    finally:
        for g in groups:
            g.close()


@pytest.mark.timeout(30)
def test_a_mark_naming_nobody_is_replaced_by_one_naming_a_rank():
    groups = attach(2)
    try:
        groups[0].mark_broken(-1)
        groups[0].mark_broken(1)
        x = np.ones(4, np.float32)
        with pytest.raises(PeerError) as info:
            groups[1].all_reduce(None, x, x, ReduceOp.SUM)
        # member 0 blamed member 1 itself, which member 1 hears as "gave up waiting for this
        # rank" (naming nobody: step.c, left()), not as "rank 0 left after an error"
        assert "gave up waiting for this rank" in str(info.value), str(info.value)
        assert failure_of(info.value).culprit == -1, str(info.value)
    finally:
        for g in groups:
            g.close()
