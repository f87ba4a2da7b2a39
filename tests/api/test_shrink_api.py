"""Group.shrink()'s arguments and the backends that cannot shrink (no processes needed)."""
from __future__ import annotations

import pytest

import adapter
from adapter.backends.base import Backend
from adapter.backends.jaccl.backend import JacclBackend
from adapter.backends.mpi.backend import MPIBackend
from adapter.backends.nccl.backend import NcclBackend
from adapter.backends.singleton import SingletonBackend
from adapter.group import Group


def test_a_group_of_one_shrinks_to_a_group_of_one_and_the_old_one_says_so():
    old = Group(SingletonBackend())
    new = old.shrink()
    assert (new.rank(), new.size()) == (0, 1)
    with pytest.raises(adapter.DistributedError, match="was shrunk into a group of 1"):
        old.shrink()  # (a collective on a group of one never reaches its backend)
    with pytest.raises(adapter.DistributedError, match="use the Group shrink\\(\\) returned"):
        old.backend.failure.check()
    assert adapter.all_sum([2.0], group=new)[0] == 2.0


def test_arguments_are_checked_before_anything_is_sent():
    group = Group(SingletonBackend())
    with pytest.raises(ValueError, match="exclude names rank 3"):
        group.shrink(exclude=[3])
    with pytest.raises(ValueError, match="min_size must be at least 1"):
        group.shrink(min_size=0)
    with pytest.raises(adapter.QuorumError, match="min_size=2"):
        group.shrink(min_size=2)


def test_a_rank_that_excludes_itself_gets_none_and_its_old_group_raises_excluded():
    group = Group(SingletonBackend())
    assert group.shrink(exclude=[0]) is None
    with pytest.raises(adapter.ExcludedError, match="excluded from the group by shrink"):
        group.shrink()


class _Named:
    """Just what Backend.shrink's refusal reads: the rank, the name, what is missing."""

    def __init__(self, cls: type) -> None:
        self.name, self.shrink_missing = cls.name, cls.shrink_missing

    def rank(self) -> int:
        return 1


@pytest.mark.parametrize("cls, missing", [(MPIBackend, "ULFM"), (NcclBackend, "ncclCommShrink"),
                                          (JacclBackend, "RDMA queue pairs")])
def test_backends_that_cannot_shrink_say_what_they_lack(cls, missing):
    with pytest.raises(adapter.DistributedError) as info:
        Backend.shrink(_Named(cls), [], None, 1.0)  # type: ignore[arg-type]
    text = str(info.value)
    assert f"rank 1: the {cls.name} backend cannot shrink a group" in text and missing in text, text


def test_grow_checks_its_arguments_and_other_backends_say_they_cannot_grow():
    group = Group(SingletonBackend())
    with pytest.raises(ValueError, match="count must be at least 1"):
        group.grow(count=0)
    with pytest.raises(adapter.DistributedError, match="the singleton backend cannot take newcomers"):
        group.grow()


def test_a_lineage_knows_the_vacant_slots_through_shrink_and_grow():
    from adapter.backends.ring.lineage import HostfileOrigin, Lineage
    first = Lineage(HostfileOrigin([["a:1"], ["b:1"], ["c:1"], ["d:1"]]), [0, 1, 2, 3])
    shrunk = first.keep([0, 1, 3])        # slot 2 died
    assert shrunk.slots == [0, 1, 3] and shrunk.vacant() == [2]
    grown = Lineage(shrunk.origin, shrunk.slots + [2])  # the newcomer follows the members
    assert grown.vacant() == [] and grown.keep([1, 2, 3]).vacant() == [0]
