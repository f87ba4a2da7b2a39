"""The public API in one process: init() caching, groups of one, conversions, argument errors."""
import json

import ml_dtypes
import numpy as np
import pytest

import adapter
from adapter import group as group_module
from adapter.arrays import as_numpy, call_view, numpy_dtype

ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR", "MLX_WORLD_SIZE",
       "NCCL_HOST_IP", "NCCL_PORT", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    group_module._reset_for_tests()
    yield
    group_module._reset_for_tests()


@pytest.fixture
def one_rank_ring(monkeypatch, tmp_path):
    path = tmp_path / "ring.json"
    path.write_text(json.dumps([["127.0.0.1:0"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(path))
    monkeypatch.setenv("MLX_RANK", "0")


def test_nothing_configured_gives_a_group_of_one():
    g = adapter.init()
    assert (g.rank(), g.size()) == (0, 1)
    assert not adapter.is_available("ring")


def test_strict_names_every_backend_and_why():
    with pytest.raises(adapter.BackendUnavailable) as info:
        adapter.init(strict=True)
    text = str(info.value)
    for name in ("ring", "jaccl", "mpi", "nccl"):
        assert f"{name}:" in text
    assert "MLX_RANK" in text


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        adapter.init(backend="tcp")
    with pytest.raises(ValueError):
        adapter.is_available("tcp")


def test_collectives_are_identity_in_a_group_of_one():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for op in (adapter.all_sum, adapter.all_max, adapter.all_min, adapter.all_gather, adapter.sum_scatter):
        assert op(x) is x
    assert adapter.broadcast(x) is x
    adapter.barrier()


def test_send_recv_need_a_peer():
    with pytest.raises(ValueError, match="out of range"):
        adapter.send(np.ones(2), 1)
    with pytest.raises(ValueError, match="out of range"):
        adapter.recv((2,), np.float32, 1)


def test_spec_case_1_first_backend_is_returned_by_later_init(one_rank_ring):
    ring = adapter.init(backend="ring")
    assert ring.backend_name == "ring"
    assert adapter.init() is ring
    assert adapter.init(backend="any") is ring
    assert adapter.init(backend="ring") is ring


def test_spec_case_2_any_is_cached(one_rank_ring):
    world = adapter.init(backend="any")
    assert world.backend_name == "ring"
    assert adapter.init() is world


def test_spec_case_3_first_created_wins_for_any(one_rank_ring):
    first = adapter.init()  # ring, created first
    again = adapter.init(backend="ring")
    assert again is first
    # a named backend that cannot start, non-strict: a group of one, and the cache is untouched
    mpi = adapter.init(backend="mpi")
    assert mpi.size() == 1 and mpi.backend_name == "singleton"
    assert adapter.init() is first


def test_any_order_prefers_explicit_configuration():
    assert group_module.ANY_ORDER == ("nccl", "jaccl", "ring", "mpi")
    # the engines that started the process come between the explicit files and MPI
    from adapter import engines
    assert engines.SOURCES == ("nccl", "jaccl", "ring", "torch-group", "torchrun", "slurm", "mpi")
    assert tuple(s for s in engines.SOURCES if s not in engines.ENGINES) == group_module.ANY_ORDER


def test_split_of_a_group_of_one(one_rank_ring):
    g = adapter.init()
    sub = g.split(3)
    assert (sub.rank(), sub.size()) == (0, 1)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                   np.uint32, np.uint64, np.float16, ml_dtypes.bfloat16, np.float32,
                                   np.float64, np.complex64])
def test_numpy_views_are_zero_copy(dtype):
    x = np.zeros((3, 4), dtype)
    view, restore = as_numpy(x)
    assert np.shares_memory(view, x)
    assert restore(view) is view


def test_torch_round_trip_every_dtype():
    torch = pytest.importorskip("torch")
    for dt in (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
               torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
               torch.complex64):
        t = torch.ones(2, 3, dtype=dt)
        view, restore = as_numpy(t)
        assert view.dtype == numpy_dtype(dt)
        assert view.ctypes.data == t.data_ptr()  # zero copy
        back = restore(view)
        assert back.dtype == dt and back.shape == t.shape and torch.equal(back, t)


def test_call_views_are_kept_by_address_and_keep_nothing_alive():
    """arrays.call_view: a tensor's bytes viewed again without x.numpy(), only for a tensor of the
    same dtype and count at that address, and the view holds no reference to the tensor."""
    torch = pytest.importorskip("torch")
    import gc
    import weakref

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    views = [call_view(t) for _ in range(3)]
    assert views[1] is views[2]  # kept from the second sight on
    for v in views:
        assert v.shape == (6,) and v.dtype == np.float32 and v.ctypes.data == t.data_ptr()
        assert np.array_equal(v, np.arange(6, dtype=np.float32))
    views[2][0] = 42  # the tensor's own memory
    assert t[0, 0] == 42
    # Other tensors starting at the same address: another dtype, another count.
    as_ints = t.view(torch.int32)
    for _ in range(2):
        v = call_view(as_ints)
        assert v.dtype == np.int32 and v.size == 6 and v.ctypes.data == t.data_ptr() and v[0] == as_ints[0, 0]
        head = call_view(t.reshape(-1)[:2])
        assert head.dtype == np.float32 and head.size == 2 and head[0] == 42
    # Not plain: another path must stage or refuse them.
    assert call_view(t.T) is None
    assert call_view(torch.ones(2, requires_grad=True)) is None
    assert call_view(torch.ones(2, dtype=torch.complex64).conj()) is None
    assert call_view(torch.ones(2, dtype=torch.bfloat16)) is None
    assert call_view(np.ones(2)) is None
    assert call_view(torch.empty(0)).size == 0
    alive = weakref.ref(t)
    del t, as_ints, views, v, head
    gc.collect()
    assert alive() is None, "a kept view kept its tensor alive"


def test_unsupported_dtype_is_named():
    with pytest.raises(TypeError, match="not supported"):
        as_numpy(np.array(["a"]))


def test_sum_scatter_needs_divisible_first_dimension(monkeypatch):
    # checked before any communication, so a group of one with a fake size is enough to see it
    class Two(adapter.Group):
        def size(self):
            return 2
    g = Two(adapter.init().backend)
    with pytest.raises(ValueError, match="divisible by the group size 2"):
        adapter.sum_scatter(np.ones(3), group=g)


def test_bitwise_reduction_of_floats_is_refused():
    from adapter.backends.base import ReduceOp
    from adapter.backends.elements import check_reducible
    with pytest.raises(TypeError, match="BXOR needs an integer"):
        check_reducible(np.dtype(np.float32), ReduceOp.BXOR)
    with pytest.raises(TypeError, match="complex"):
        check_reducible(np.dtype(np.complex64), ReduceOp.MAX)


def test_half_precision_sums_accumulate_in_float32():
    from adapter.backends.base import ReduceOp
    from adapter.backends.elements import reduce_many
    parts = [np.full(4, 0.1, ml_dtypes.bfloat16) for _ in range(64)]
    out = np.empty(4, ml_dtypes.bfloat16)
    reduce_many(out, parts, ReduceOp.SUM)
    exact = 64 * float(np.float32(parts[0][0]))
    assert abs(float(out[0]) - exact) <= abs(exact) * 2 ** -7  # one bfloat16 rounding


def test_scalar_inputs_keep_their_shape():
    view, _ = as_numpy(np.float64(2.5))
    assert view.shape == () and view.dtype == np.float64
    view, _ = as_numpy([[1, 2], [3, 4]])
    assert view.shape == (2, 2)


def test_lazy_conjugate_and_negative_torch_views_and_big_endian_numpy_convert():
    torch = pytest.importorskip("torch")
    conj = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64).conj()
    arr, restore = as_numpy(conj)
    assert arr.tolist() == [1 - 1j, 2 + 1j] and restore(arr).is_conj() is False
    neg = torch._neg_view(torch.arange(3, dtype=torch.float32))
    assert as_numpy(neg)[0].tolist() == [0, -1, -2]
    big = np.arange(3, dtype=">f4")
    arr, _ = as_numpy(big)
    assert arr.dtype == np.float32 and arr.dtype.isnative and arr.tolist() == [0, 1, 2]


def test_reduce_op_names_in_any_case():
    x = np.ones(3)
    assert adapter.all_reduce(x, "MAX") is x and adapter.reduce_scatter(x, "Sum") is x
    with pytest.raises(ValueError, match="unknown reduce op 'avg'; choose one of sum, prod"):
        adapter.all_reduce(x, "avg")
